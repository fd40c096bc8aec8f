"""`benchmarks/peers.py` on the CPU: arms parsed, points ordered, each arm's process run end to end on a tiny shape,
a failed, timed-out or out-of-memory arm recorded as rows, Unsloth skipped with a line, the table rendered, and
``--profile``'s step split (kernel kinds, the GPU's busy time) on synthetic kernel events."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks import peers
from benchmarks.peer_arms import lightning_arm, measure
from benchmarks.peer_arms.spec import parse_arm, parse_point, point
from benchmarks.peer_arms.table import render


def test_an_arm_is_a_system_and_its_options() -> None:
    arm = parse_arm("ours+liger+budget=7.5GB+offload+tiled")
    assert arm.system == "ours" and arm.budget == "7.5GB" and arm.loss == "chunked:1024"
    assert arm.options == {"liger": True, "budget": "7.5GB", "offload": True, "tiled": True}
    assert parse_arm("peft+hfloss").loss == "hf" and parse_arm("resident+chunked=512").loss == "chunked:512"
    assert parse_arm("unsloth").loss == "unsloth" and parse_arm("unsloth+gc=false").options == {"gc": "false"}
    with pytest.raises(ValueError, match=r"unsloth takes no option 'liger'; its options are gc"):
        parse_arm("unsloth+liger")
    with pytest.raises(ValueError, match=r"system 'hf' is not one of ours, resident, peft, unsloth"):
        parse_arm("hf")
    with pytest.raises(ValueError, match=r"budget needs a value"):
        parse_arm("ours+budget")
    with pytest.raises(ValueError, match=r"hfloss and chunked are two losses"):
        parse_arm("ours+hfloss+chunked")
    assert parse_arm("resident+liger+det").options == {"liger": True, "det": True}
    with pytest.raises(ValueError, match=r"det is a flag and takes no value"):
        parse_arm("ours+det=1")
    with pytest.raises(ValueError, match=r"unsloth takes no option 'det'"):
        parse_arm("unsloth+det")


def test_points_run_shortest_first_with_fewer_steps_beyond_16k() -> None:
    points = [parse_point(k) for k in ("random:32768x1", "rows:4096x2", "random:4096x1", "random:16384x1")]
    assert [p.key for p in sorted(points)] == ["random:4096x1", "rows:4096x2", "random:16384x1", "random:32768x1"]
    assert point(16384).steps(None) == (5, 2) and point(32768).steps(None) == (3, 1)
    assert point(8192, 4).steps(None) == (3, 1) and point(32768).steps(7) == (7, 1)
    with pytest.raises(ValueError, match=r"rows:TOKENSxBATCH"):
        parse_point("rows:4096")


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--shape", "tiny", "--device", "cpu", "--steps", "1", "--work", str(tmp_path), *extra]


def test_driver_runs_each_arm_in_its_own_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    probe = tmp_path / "no-probe.py"
    peers.main(_args(tmp_path, "--tokens", "32", "--rows", "64x2", "--arms", "unsloth", "ours", "resident", "peft",
                     "--probe", str(probe)))  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert {(r["arm"], r["point"]) for r in rows} == {
        (arm, key) for arm in ("unsloth", "ours", "resident", "peft") for key in ("random:32x1", "rows:64x2")
    }
    for row in rows:
        if row["arm"] == "unsloth":
            assert row["status"] == "skipped" and f"no peer probe at {probe}" in row["error"]
            continue
        assert row["status"] == "ok", row
        assert row["s_per_step"] > 0 and row["tokens_per_s"] > 0 and row["steps"] == 1 and row["warmup"] == 2
        assert row["device"] == "cpu" and row["versions"]["torch"] == torch.__version__
        assert row["settings"]["loss"] == "chunked:1024" and row["settings"]["cap_gib"] is None
    by = {(r["arm"], r["point"]): r for r in rows}
    assert by["ours", "random:32x1"]["strategy"]["strategy"] == "blockwise"
    assert by["resident", "random:32x1"]["settings"]["checkpointing"] == "none"
    assert by["peft", "random:32x1"]["settings"]["checkpointing"].startswith("HF gradient checkpointing")
    assert by["peft", "random:32x1"]["system"] == "transformers+peft"
    # The packed rows: two of at most 64 tokens a step, from the shipped data, trained on (a finite loss).
    packed = by["ours", "rows:64x2"]
    assert packed["batch"] == 2 and 64 < packed["step_tokens_mean"] <= 128 and packed["loss_first"] > 0
    table = capsys.readouterr().out.split("\n\n")[-1]
    assert "| tiny | - | rows:64x2 | peft | ok |" in table
    assert "| tiny | - | random:32x1 | unsloth | skipped: no peer probe at" in table


def test_an_oom_is_a_row_and_longer_points_are_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = lightning_arm.PeerModule.training_step

    def oom_beyond_40(self: Any, batch: dict[str, Any], idx: int) -> torch.Tensor:
        if batch["input_ids"].shape[-1] > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return step(self, batch, idx)

    monkeypatch.setattr(lightning_arm.PeerModule, "training_step", oom_beyond_40)
    out = tmp_path / "rows.jsonl"
    lightning_arm.main(["--arm", "resident", "--shape", "tiny", "--device", "cpu", "--steps", "1", "--out", str(out),
                        "--points", "random:64x1", "random:32x1", "random:128x1"])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["point"], r["status"]) for r in rows] == [
        ("random:32x1", "ok"), ("random:64x1", "oom"), ("random:128x1", "skipped")
    ]  # fmt: skip
    assert "out of memory" in rows[1]["error"] and rows[2]["error"] == "random:64x1 ran out of memory"


@pytest.mark.parametrize(
    ("code", "timeout", "status"),
    [
        ("raise SystemExit(3)", 60.0, "crashed"),  # a crash after the first point
        ("import time; time.sleep(60)", 1.0, "timeout"),  # still running at the arm's timeout
        (None, 60.0, None),  # control: every point reported, nothing added
    ],
)
def test_a_failed_arm_is_rows_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str | None, timeout: float, status: str | None
) -> None:
    points = [point(32), point(64)]

    def command(arm: Any, mine: list, args: Any, out: Path, budgets: dict) -> list[str]:
        write = "".join(
            f"open({str(out)!r}, 'a').write({json.dumps(json.dumps({'arm': arm.name, 'point': p.key, 'status': 'ok'}))}"
            " + '\\n'); "
            for p in (mine[:1] if code else mine)
        )
        return [sys.executable, "-c", write + (code or "")]

    monkeypatch.setattr(peers, "arm_command", command)
    args = peers.main.__globals__["argparse"].Namespace(work=tmp_path, arm_timeout=timeout, shape="tiny", cap_gib=None)
    rows = peers.run_arm(parse_arm("ours"), points, args, {})
    assert [r["point"] for r in rows] == ["random:32x1", "random:64x1"]
    assert rows[0]["status"] == "ok"
    if status is None:
        assert rows[1]["status"] == "ok"
    else:
        assert rows[1]["status"] == status and rows[1]["error"].startswith(status)


def test_unsloth_not_importable_is_a_skip_line(tmp_path: Path) -> None:
    probe, env = tmp_path / "probe.py", tmp_path / "peer-env.sh"
    probe.write_text("")
    env.write_text("export PEERS_TEST=1\n")  # puts nothing on the path: unsloth stays missing here
    args = peers.main.__globals__["argparse"].Namespace(probe=probe, peer_env=env, device="cuda")
    assert peers.unsloth_skip(args) == f"unsloth is not importable after sourcing {env}"
    args.peer_env = tmp_path / "missing.sh"
    assert peers.unsloth_skip(args) == f"no {args.peer_env} (copy ../shared/peers/peer-env.sh there)"


def test_equal_memory_gives_ours_unsloths_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, tuple[list[str], dict[str, int]]] = {}

    def fake_arm(arm: Any, mine: list, args: Any, budgets: dict[str, int]) -> list[dict[str, Any]]:
        calls[arm.name] = ([p.key for p in mine], budgets)
        peak = {"random:32x1": 1.5, "random:64x1": None}
        return [{"arm": arm.name, "point": p.key, "data": p.data, "status": "ok" if peak.get(p.key) else "oom",
                 "peak_reserved_gb": peak.get(p.key)} for p in mine]  # fmt: skip

    monkeypatch.setattr(peers, "run_arm", fake_arm)
    monkeypatch.setattr(peers, "unsloth_skip", lambda args: None)
    peers.main(_args(tmp_path, "--tokens", "64", "32", "--rows", "64x2", "--arms", "ours", "unsloth",
                     "--equal-memory"))  # fmt: skip
    assert list(calls) == ["unsloth", "ours", "ours+liger+fused+budget=unsloth"]  # Unsloth first
    assert calls["ours+liger+fused+budget=unsloth"] == (["random:32x1"], {"random:32x1": 1_500_000_000})
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    skipped = {r["point"] for r in rows if r["arm"] == "ours+liger+fused+budget=unsloth" and r["status"] == "skipped"}
    assert skipped == {"random:64x1", "rows:64x2"}


def test_table_ratios_are_over_unsloth_at_the_same_point() -> None:
    common = {"shape": "7b", "settings": {"cap_gib": 22.0}, "device": "NVIDIA H100", "steps": 5, "warmup": 2,
              "step_tokens": 4096, "versions": {"torch": "2.11", "unsloth": "2026.10.9"}}  # fmt: skip
    rows = [
        {**common, "arm": "unsloth", "point": "random:4096x1", "status": "ok", "s_per_step": 2.0,
         "tokens_per_s": 2048, "peak_allocated_gb": 8.0, "peak_reserved_gb": 10.0},
        {**common, "arm": "ours", "point": "random:4096x1", "status": "ok", "s_per_step": 3.0,
         "tokens_per_s": 1365, "peak_allocated_gb": 4.0, "peak_reserved_gb": 5.0},
        {**common, "arm": "peft", "point": "random:4096x1", "status": "oom", "error": "OutOfMemoryError: CUDA",
         "peak_allocated_gb": 21.0, "peak_reserved_gb": 22.0},
    ]  # fmt: skip
    table = render(rows)
    assert "NVIDIA H100" in table and "unsloth 2026.10.9" in table and "median of 5 steps after 2 warm-up" in table
    assert "| 7b | 22.0 | random:4096x1 | ours | ok | 3.000 | 1365 | 4.00 | 5.00 | 1.50x | 0.50x |" in table
    assert "| 7b | 22.0 | random:4096x1 | unsloth | ok | 2.000 | 2048 | 8.00 | 10.00 | 1x | 1x |" in table
    assert (
        "| 7b | 22.0 | random:4096x1 | peft | oom: OutOfMemoryError: CUDA | - | - | 21.00 | 22.00 | - | 2.20x |"
        in table
    )


#: A stand-in for the peer probe (Unsloth needs a GPU): its three calls, a tiny bf16 model, the shapes it is fed.
_PROBE = """
import torch, transformers
from peft import LoraConfig, get_peft_model

def _set_env(args):
    pass

def prepare_checkpoint(ckpt, max_seq):
    return ckpt, {"view": None}

def load_unsloth(path, args):
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = get_peft_model(transformers.AutoModelForCausalLM.from_config(config), LoraConfig(r=4,
                           target_modules=["q_proj"]))
    shapes = []
    model.register_forward_pre_hook(lambda m, a, kw: shapes.append(list(kw["input_ids"].shape)), with_kwargs=True)
    return model, {"grad_ckpt": args.grad_ckpt, "max_seq": args.max_seq, "shapes": shapes}
"""


def test_unsloth_arm_feeds_the_probes_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Set, so that importing the arm (which sets Unsloth's allocator default when unset) leaves the session's as it was.
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    from benchmarks.peer_arms import unsloth_arm

    probe, out = tmp_path / "probe.py", tmp_path / "rows.jsonl"
    probe.write_text(_PROBE)
    common = ["--ckpt", str(tmp_path), "--device", "cpu", "--steps", "1", "--out", str(out)]
    unsloth_arm.main(["--arm", "unsloth+gc=false", "--probe", str(probe), "--points", "rows:64x2", "random:32x1",
                      *common])  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["point"], r["status"], r["system"]) for r in rows] == [
        ("random:32x1", "ok", "unsloth"), ("rows:64x2", "ok", "unsloth")
    ]  # fmt: skip
    notes = rows[-1]["settings"]["unsloth"]
    assert notes["grad_ckpt"] == "false" and notes["max_seq"] == 128  # the packed pair is one row of 128
    # Three steps a point (two of warm-up); the packed batch of two rows reaches the model as one row.
    assert notes["shapes"][:3] == [[1, 32]] * 3 and {s[0] for s in notes["shapes"][3:]} == {1}
    packed = [s[1] for s in notes["shapes"][3:]]
    assert all(64 < n <= 128 for n in packed) and rows[-1]["step_tokens_mean"] == sum(packed) / len(packed) > 0
    assert rows[-1]["s_per_step"] > 0 and rows[-1]["settings"]["rows_as"] == unsloth_arm.ROWS_AS_ONE

    unsloth_arm.main(["--arm", "unsloth", "--probe", str(tmp_path / "none.py"), "--points", "random:32x1", *common])
    failed = json.loads(out.read_text().splitlines()[-1])
    assert failed["status"] == "error" and failed["phase"] == "load" and "none.py does not exist" in failed["error"]


def test_busy_time_counts_overlapping_kernels_once() -> None:
    # Two streams' kernels that overlap: the GPU was busy 0..15, not 10 + 10.
    assert measure.busy_us([(5.0, 15.0), (0.0, 10.0)]) == 15.0
    assert measure.busy_us([(0.0, 10.0), (2.0, 3.0), (10.0, 12.0)]) == 12.0  # one inside another, one touching
    # Control: disjoint kernels are summed, the gap between them left out.
    assert measure.busy_us([(20.0, 30.0), (0.0, 10.0)]) == 20.0
    assert measure.busy_us([]) == 0.0


def test_kernel_kinds_count_each_kernel_once() -> None:
    kinds = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 4> >(Flash_fwd_params)": "attention",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "gemm",
        "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, int)": "dequantize",
        "liger_cross_entropy_kernel": "loss",  # a Triton kernel, but the loss's: loss is matched first
        "_cross_entropy_forward": "loss",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*)":
            "loss",
        "triton_red_fused__log_softmax_nll_loss_forward_0": "loss",
        "_rms_norm_forward_kernel": "triton",  # bare names: Triton's (Liger, Unsloth)
        "_DWf_DW_dfg_kernel": "triton",
        "_rope_embedding": "triton",
        "triton_poi_fused_add_mul_0": "triton",
        # Control: C++ kernels that are none of these (their demangled names carry parameters).
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)": "other",
        "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, SoftMaxForwardEpilogue>(float*)": "other",
        "Memset (Device)": "other",
    }  # fmt: skip
    assert {name: measure.kernel_kind(name) for name in kinds} == kinds


def _event(name: str, start: float, end: float, device: str = "CUDA", annotation: bool = False) -> SimpleNamespace:
    kind = getattr(torch.autograd.DeviceType, device)
    return SimpleNamespace(
        name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end), is_user_annotation=annotation
    )


def test_step_profile_splits_a_step_on_two_streams() -> None:
    events = [
        _event("nvjet_tst_gemm", 100.0, 1100.0),  # compute stream
        _event("_rms_norm_forward_kernel", 1500.0, 2000.0),  # after a 400 us gap: idle
        _event("nvjet_tst_gemm", 1800.0, 2600.0),  # a side stream, overlapping the norm by 200 us
        _event("Memcpy HtoD (Pinned -> Device)", 0.0, 3000.0),  # a copy engine's: no kernel, not busy
        _event("aten::mm", 0.0, 5000.0, device="CPU"),  # a CPU event: not the GPU's
        _event("cudaLaunchKernel", 50.0, 60.0, device="CPU"),
        # With CPU activity on, a user range mirrored on the device's timeline: no kernel.
        _event("Optimizer.step#AdamW.step", 0.0, 4000.0, annotation=True),
    ]
    row = measure.step_profile(SimpleNamespace(events=lambda: events))
    assert row["step_kernels_ms"] == {"attention": 0.0, "gemm": 1.8, "dequantize": 0.0, "loss": 0.0, "triton": 0.5,
                                      "other": 0.0}  # fmt: skip
    # 2.3 ms of kernels, 0.2 of it overlapping: busy 2.1 in a window of 2.5 (the 0.4 gap idle).
    assert row["busy_ms"] == 2.1 and row["window_ms"] == 2.5 and row["memcpy_ms"] == 3.0
    assert row["top"] == [["nvjet_tst_gemm", 1.8], ["_rms_norm_forward_kernel", 0.5]]
    # layer_levers' split: the same kinds per layer, and the copies.
    per_layer = measure.kernel_split_of(SimpleNamespace(events=lambda: events), 2)
    assert per_layer["gemm"] == 0.9 and per_layer["memcpy"] == 1.5 and per_layer["top"][0] == ["nvjet_tst_gemm", 0.9]


def test_profile_adds_one_untimed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = lightning_arm.PeerModule.training_step
    calls: list[int] = []

    def counted(self: Any, batch: dict[str, Any], idx: int) -> torch.Tensor:
        calls.append(idx)
        return step(self, batch, idx)

    monkeypatch.setattr(lightning_arm.PeerModule, "training_step", counted)
    out = tmp_path / "rows.jsonl"
    common = ["--arm", "resident", "--shape", "tiny", "--device", "cpu", "--steps", "1", "--points", "random:32x1"]
    lightning_arm.main([*common, "--out", str(out), "--profile"])
    row = json.loads(out.read_text())
    # Two warm-up steps, one timed, one profiled: the median is of the timed one only.
    assert calls == [0, 1, 2, 3] and row["status"] == "ok" and len(row["step_times"]) == 1
    assert row["profiled_step"] == 3 and row["profiled_step_s"] > 0
    # On the CPU there are no device events: the fields are there, all zero.
    assert set(row["step_kernels_ms"]) == {"attention", "gemm", "dequantize", "loss", "triton", "other"}
    assert row["busy_ms"] == row["window_ms"] == row["memcpy_ms"] == 0.0 and row["top"] == []
    # Control: without --profile, no extra step and no profile fields.
    calls.clear()
    lightning_arm.main([*common, "--out", str(tmp_path / "plain.jsonl")])
    plain = json.loads((tmp_path / "plain.jsonl").read_text())
    assert calls == [0, 1, 2] and "step_kernels_ms" not in plain and len(plain["step_times"]) == 1
    # The driver passes --profile on to each arm's process.
    args = SimpleNamespace(shape="tiny", cap_gib=None, steps=1, profile=True, device="cpu")
    assert "--profile" in peers.arm_command(parse_arm("ours"), [point(32)], args, out, {})
    plain_args = SimpleNamespace(**{**vars(args), "profile": False})
    assert "--profile" not in peers.arm_command(parse_arm("ours"), [point(32)], plain_args, out, {})


def test_unsloth_arm_profiles_one_extra_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    from benchmarks.peer_arms import unsloth_arm

    probe, out = tmp_path / "probe.py", tmp_path / "rows.jsonl"
    probe.write_text(_PROBE)
    unsloth_arm.main(["--arm", "unsloth", "--probe", str(probe), "--ckpt", str(tmp_path), "--device", "cpu",
                      "--steps", "2", "--points", "random:32x1", "--out", str(out), "--profile"])  # fmt: skip
    row = json.loads(out.read_text())
    # Two warm-up steps, two timed, one profiled (the model saw five batches); the median is of the two.
    assert len(row["settings"]["unsloth"]["shapes"]) == 5 and len(row["step_times"]) == 2
    assert row["status"] == "ok" and row["profiled_step"] == 4 and row["busy_ms"] == 0.0
    assert set(row["step_kernels_ms"]) == {"attention", "gemm", "dequantize", "loss", "triton", "other"}


def test_noattn_plans_without_kept_attention_in_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ours+noattn``: every StepBudget the strategy builds in that process keeps no attention outputs."""
    from lightning_blockwise.planning.step_budget import StepBudget
    from lightning_blockwise.strategy import run as strategy_run

    stub = StepBudget(
        config=None, num_layers=1, activation_bytes=2, block_bytes=[1], prefetch_depth=1, fixed_bytes=0,
        trainable_bytes=0, budget=None, offload=None, device_limit=None,
    )  # fmt: skip
    monkeypatch.setattr(strategy_run, "module_budget", lambda *args, **kwargs: stub)
    # Control: the plain arm leaves the planner as it is.
    lightning_arm.strategy_for(parse_arm("ours"), parse_point("random:64x1"), {})
    assert strategy_run.module_budget().keep_attention
    for _ in range(2):  # a second point of the arm does not wrap the wrapper
        lightning_arm.strategy_for(parse_arm("ours+noattn"), parse_point("random:64x1"), {})
    assert strategy_run.module_budget().keep_attention is False
    assert strategy_run.module_budget.keeps_no_attention  # type: ignore[attr-defined]
