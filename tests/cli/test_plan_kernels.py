"""`lightning-blockwise plan --kernels`: the layers the plan counts (NOTE [ The kernels plan counts ]).

`modelled_kernels` (cli/plan_kernels.py) decides; the single-length report, the card's recommendation, `--longest`
and `--table` carry it to the memory model (`StepShape.fused_norm`, `fused_mlp`).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable

import pytest
import torch

from lightning_blockwise.cli import main, plan_report
from lightning_blockwise.cli.plan_kernels import modelled_kernels
from lightning_blockwise.planning.footprint import ModelSizes
from lightning_blockwise.planning.shapes import shape_config
from lightning_blockwise.planning.sizing import model_sizes, recommend
from lightning_blockwise.planning.step_kernels import StepKernels

GiB = 2**30


@pytest.fixture(scope="module")
def seven() -> ModelSizes:
    return model_sizes(shape_config("7b"), dtype=torch.bfloat16, lora_rank=16)


@pytest.fixture
def liger_installed(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Set whether ``liger_kernel`` is importable as ``--kernels auto`` sees it."""
    find_spec = importlib.util.find_spec

    def installed(present: bool) -> None:
        def spec(name: str, *args: object) -> object:
            if name == "liger_kernel":
                return find_spec("json") if present else None
            return find_spec(name, *args)

        monkeypatch.setattr(importlib.util, "find_spec", spec)

    return installed


def test_each_choice_and_its_reason() -> None:
    liger = modelled_kernels("liger", "qwen2")
    assert (liger.liger, liger.fused_mlp) == (True, True) and "(--kernels liger)" in liger.reason
    none = modelled_kernels("none", "qwen2")
    assert (none.liger, none.fused_mlp) == (False, False) and "(--kernels none)" in none.reason
    # With --mlp-tile-tokens every MLP is tiled: its RMSNorm and RoPE only, as CausalLMFineTune installs them.
    tiled = modelled_kernels("liger", "qwen2", mlp_tiled=True)
    assert (tiled.liger, tiled.fused_mlp) == (True, False) and "SwiGLU" not in tiled.reason
    # Liger leaves an MoE's experts alone: its RMSNorm and RoPE only.
    moe = modelled_kernels("liger", "qwen3_moe")
    assert (moe.liger, moe.fused_mlp) == (True, False) and "SwiGLU" not in moe.reason
    # An architecture Liger does not know keeps its own layers, and the report says why.
    unknown = modelled_kernels("liger", "gpt_neox")
    assert not unknown.liger and "Liger-Kernel does not know model_type 'gpt_neox'" in unknown.reason
    with pytest.raises(ValueError, match="kernels='triton' is not a choice; choose one of auto, liger, none"):
        modelled_kernels("triton", "qwen2")


def test_auto_follows_whether_liger_kernel_is_installed_here(liger_installed: Callable[[bool], None]) -> None:
    liger_installed(True)
    auto = modelled_kernels("auto", "qwen2")
    assert auto.liger and auto.fused_mlp and "Liger-Kernel is installed here" in auto.reason
    liger_installed(False)
    auto = modelled_kernels("auto", "qwen2")
    assert not auto.liger and "Liger-Kernel is not installed here" in auto.reason
    # Control: the named choices do not look.
    assert modelled_kernels("liger", "qwen2").liger and not modelled_kernels("none", "qwen2").liger


def test_auto_is_the_default_and_answers_as_liger_or_none(
    liger_installed: Callable[[bool], None], capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["plan", "--shape", "7b", "--seq-len", "65536", "--offload-activations", "on", "--loss-chunk-tokens", "1024"]

    def peak(*more: str) -> int:
        main([*args, *more, "--json"])
        return json.loads(capsys.readouterr().out)["predicted_peak_bytes"]

    liger_installed(True)
    assert peak() == peak("--kernels", "liger") < peak("--kernels", "none")
    liger_installed(False)
    assert peak() == peak("--kernels", "none")


def test_the_single_length_report_counts_liger_and_says_so(seven: ModelSizes) -> None:
    config = shape_config("7b")
    options = dict(tokens=65536, offload_activations=True, loss_chunk_tokens=1024, mlp_tile_tokens=4096)
    liger = plan_report(config, kernels="liger", **options)
    own = plan_report(config, **options)  # the API's default: the model's own layers
    assert (liger["kernels"], own["kernels"]) == ("liger", "none") and own == plan_report(
        config, kernels="none", **options
    )
    # The memory model with Liger's RMSNorm, the MLP tiled so its SwiGLU is not installed (install_kernels).
    expected = seven.residency(65536, offload_inputs=True, kernels=StepKernels(1024, 4096, fused_norm=True))
    assert liger["predicted_peak_bytes"] == expected.predicted_peak < own["predicted_peak_bytes"]
    assert liger["fused_mlp"] is False
    untiled = plan_report(config, kernels="liger", tokens=4096)
    assert untiled["fused_mlp"] is True


def test_the_recommendation_counts_liger_s_swiglu_only_where_it_leaves_the_mlp_untiled(seven: ModelSizes) -> None:
    liger = StepKernels(fused_norm=True, fused_mlp=True)
    short = recommend(seven, 24 * GiB, 4096, kernels=liger)
    assert short.mlp_tile_tokens is None and (short.fused_norm, short.fused_mlp) == (True, True)
    assert short.plan == seven.residency(4096, short.block_size, budget=short.budget, kernels=liger)
    # Control: where the recommendation tiles the MLPs the recipe installs Liger's RMSNorm and RoPE only.
    long = recommend(seven, 24 * GiB, 131072, kernels=liger)
    assert long.mlp_tile_tokens == 4096 and (long.fused_norm, long.fused_mlp) == (True, False)
    assert seven.step_budget(kernels=StepKernels(mlp_tile_tokens=4096, fused_mlp=True)).kernels.fused_mlp is False
    assert seven.step_budget(kernels=liger).kernels.fused_mlp is True


def test_the_settings_to_paste_name_the_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    main(["plan", "--shape", "7b", "--seq-len", "131072", "--card", "24GiB", "--kernels", "liger", "--json"])
    advice = json.loads(capsys.readouterr().out)["recommendation"]
    assert advice["fits"] and advice["model_settings"]["kernels"] == "liger"
    main(["plan", "--shape", "7b", "--seq-len", "131072", "--card", "24GiB", "--kernels", "none", "--json"])
    assert "kernels" not in json.loads(capsys.readouterr().out)["recommendation"]["model_settings"]


def test_table_says_what_it_counted_on_its_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--shape", "7b", "--host-ram", "128GiB", "--table", "--cards", "24", "--lengths", "131072"]
    main([*args, "--kernels", "liger"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("kernels: Liger-Kernel's RMSNorm and RoPE, and its SwiGLU where the MLPs are untiled")
    # Control: --kernels none prints the table as before the option, and nothing after it.
    main([*args, "--kernels", "none"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| longest |")
