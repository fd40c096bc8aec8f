"""Chat formats: how a conversation becomes text, split into the pieces trained on and the pieces not.

Two formats: the tokenizer's (or a given) Jinja chat template, and the fixed Alpaca format for
tokenizers without one. Either turns a conversation into :class:`Segment` s, each marked
trained (an assistant turn) or not; :mod:`~lightning_blockwise.recipes.encoding` tokenizes them.

Example::

    chat = chat_format(tokenizer, "auto")  # the tokenizer's template, else Alpaca
    chat.segments([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from transformers import PreTrainedTokenizerBase

#: ``chat_template`` values that name a format rather than give a template.
AUTO, ALPACA = "auto", "alpaca"

# NOTE [ Assistant masks from rendered prefixes ]
#
# Training on the assistant turns only needs to know which tokens of a rendered conversation are the assistant's.
# Hugging Face's `apply_chat_template(..., return_assistant_tokens_mask=True)` knows it only from `{% generation %}`
# markers inside the template, which the Qwen2.5 and Llama-3 templates (and most others) do not have: there it
# returns a mask of zeros. So the masks are derived from the template itself, by rendering prefixes of the
# conversation. For the k-th assistant message at index a:
#
#     prompt_k = render(messages[:a], add_generation_prompt=True)   # everything before the reply, header included
#     full_k   = render(messages[:a + 1])                           # the same, with the reply
#
# and the reply is the text full_k[len(prompt_k):] (its end-of-turn token included, so the model learns to stop),
# the context before it prompt_k[len(full_{k-1}):]. That holds only if the rendering is prefix-consistent: full_k
# starts with prompt_k, and prompt_k with full_{k-1}. Templates that rewrite earlier turns once a later one exists
# (Qwen3 and DeepSeek-R1 drop the reasoning of earlier assistant turns) are
# not, and are refused with the turn that breaks it: no mask is guessed. Messages after the last assistant turn
# would teach nothing and are left out.
#
# The pieces are then tokenized apart (encoding.py), so that no token straddles a mask boundary, and the prompt of
# a single exchange gets the ids it has at inference, where it ends the text too. With the pre-tokenizers of Llama-3
# and Qwen2, which keep a run of newlines in one piece, these are also the ids of the whole conversation tokenized
# at once: every boundary of these templates sits next to a special token or a newline. GPT-2's split differs:
# "\n\n" before a word becomes two pieces, at the end of a text one, so across a Llama-3 header the ids here differ
# from the whole conversation's. tests/recipes/test_chat.py checks both.


@dataclass(frozen=True)
class Segment:
    """A piece of a rendered conversation, and whether its tokens are trained on (an assistant turn)."""

    text: str
    trained: bool


class ChatFormat(ABC):
    """How conversations become text: see :func:`chat_format`.

    Attributes:
        name: What the log calls this format.
    """

    name: str

    @abstractmethod
    def segments(self, messages: list[dict[str, Any]]) -> list[Segment]:
        """The conversation as text pieces, in order, up to the end of its last assistant turn.

        Raises:
            MisconfigurationException: If the format cannot tell the assistant turns apart.
        """

    def leading_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """Token ids before the first segment's text (Alpaca's BOS); a template writes its own as text."""
        return []

    def instruction_messages(self, instruction: str, extra: str, output: str) -> list[dict[str, Any]]:
        """An instruction record as a user turn (the instruction, then the input) and an assistant turn."""
        user = {"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction}
        return [user, {"role": "assistant", "content": output}]


class TemplateFormat(ChatFormat):
    """A Jinja chat template, rendered by ``tokenizer.apply_chat_template``; assistant turns found from prefixes.

    See NOTE [ Assistant masks from rendered prefixes ].

    Args:
        tokenizer: The tokenizer (its special tokens are the template's variables).
        template: The Jinja source.
        name: What the log and the errors call it (``"the tokenizer's chat template"``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str, name: str) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.name = name

    def segments(self, messages: list[dict[str, Any]]) -> list[Segment]:
        """See :meth:`ChatFormat.segments`; raises if the template's rendering is not prefix-consistent."""
        segments: list[Segment] = []
        done = ""
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:index], add_generation_prompt=True)
            full = self._render(messages[: index + 1], add_generation_prompt=False)
            if not prompt.startswith(done):
                raise MisconfigurationException(
                    f"InstructionDataModule: {self.name} renders the conversation up to message"
                    f" {index} (counting from 0) so that it no longer begins with its rendering up to the previous"
                    " assistant turn: it rewrites earlier turns (e.g. drops their reasoning), so the assistant turns"
                    " cannot be found by rendering prefixes. Use a template that renders each turn the same way"
                    " whatever follows (pass it as `chat_template`), or `chat_template='alpaca'`."
                )
            if not full.startswith(prompt):
                raise MisconfigurationException(
                    f"InstructionDataModule: {self.name} does not render the prompt (with the generation prompt)"
                    " as a prefix of the full conversation, so the response cannot be told apart"
                    f" for masking (assistant message {index}, counting from 0). Use a template that does (pass it as"
                    " `chat_template`), or `chat_template='alpaca'`."
                )
            segments += [Segment(prompt[len(done) :], False), Segment(full[len(prompt) :], True)]
            done = full
        return segments

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateSyntaxError as error:
            raise MisconfigurationException(
                f"InstructionDataModule: {self.name} is not a valid Jinja template: line {error.lineno}:"
                f" {str(error).rstrip('.')}."
                " Fix the template's syntax, or choose another `chat_template` ('auto', 'alpaca', or a template)."
            ) from None
        except TemplateError as error:
            if type(error) is not TemplateError:
                # A subclass is Jinja's own (an undefined name, a bad filter call): the template is at fault.
                raise MisconfigurationException(
                    f"InstructionDataModule: {self.name} failed while rendering a conversation"
                    f" ({type(error).__name__}: {str(error).rstrip('.')}). Fix the template, or choose another"
                    " `chat_template`."
                ) from None
            # The template refused on its own (`raise_exception`, a plain `TemplateError`): about roles, tools, a
            # system turn, whatever its authors check. Its message is the diagnosis, so it leads, quoted as the
            # template's; what was rendered follows, since a prefix with the generation prompt is ours, not the record.
            roles = [message["role"] for message in messages]
            prompt = ", with the generation prompt" if add_generation_prompt else ""
            raise MisconfigurationException(
                f"InstructionDataModule: {self.name} raised its own error: {str(error).strip()!r} (rendering the first"
                f" {len(messages)} messages of a conversation{prompt}, roles {roles}). That message is the template's"
                " (its `raise_exception`): change the record as it asks, or choose another `chat_template`."
            ) from None


class AlpacaFormat(ChatFormat):
    """The Alpaca prompt format, for tokenizers without a chat template.

    An instruction record renders as ``### Instruction:`` (and ``### Input:``) then
    ``### Response:`` and the output closed by EOS, after the BOS token; a conversation as
    the same blocks turn by turn, a system message as its text on its own.
    """

    name = "the built-in Alpaca format"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.eos = tokenizer.eos_token or ""

    def segments(self, messages: list[dict[str, Any]]) -> list[Segment]:
        """See :meth:`ChatFormat.segments`."""
        last = max(index for index, message in enumerate(messages) if message["role"] == "assistant")
        segments = []
        for message in messages[: last + 1]:
            role, content = message["role"], message["content"]
            if role == "assistant":
                segments += [Segment("### Response:\n", False), Segment(content + self.eos, True)]
            elif role == "system":
                segments.append(Segment(f"{content}\n\n", False))
            else:
                extra = message.get("input") or ""
                text = f"### Instruction:\n{content}\n\n" + (f"### Input:\n{extra}\n\n" if extra else "")
                segments.append(Segment(text, False))
        return segments

    def leading_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The BOS token, as an id (tokenizing its text could merge it with what follows)."""
        return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def instruction_messages(self, instruction: str, extra: str, output: str) -> list[dict[str, Any]]:
        """As :meth:`ChatFormat.instruction_messages`, the input kept apart for its own ``### Input:`` section."""
        return [{"role": "user", "content": instruction, "input": extra}, {"role": "assistant", "content": output}]


def chat_format(tokenizer: PreTrainedTokenizerBase, chat_template: str = AUTO) -> ChatFormat:
    """The format ``chat_template`` names for ``tokenizer``.

    Args:
        tokenizer: The tokenizer.
        chat_template: ``"auto"``: the tokenizer's chat template if it has one, else Alpaca; ``"alpaca"``: always
            Alpaca; else a Jinja chat template, given as its source or as the path of a file that holds it.

    Raises:
        MisconfigurationException: If ``chat_template`` is none of those, or the tokenizer holds several named
            templates and none is called ``default``.
    """
    if chat_template == ALPACA:
        return AlpacaFormat(tokenizer)
    if chat_template == AUTO:
        own = tokenizer.chat_template
        if isinstance(own, dict):
            if "default" not in own:
                raise MisconfigurationException(
                    f"InstructionDataModule(chat_template='auto'): the tokenizer has the chat templates {sorted(own)}"
                    " and none called 'default'. Pass the one to use as `chat_template` (its Jinja source or file)."
                )
            own = own["default"]
        return TemplateFormat(tokenizer, own, "the tokenizer's chat template") if own else AlpacaFormat(tokenizer)
    if "{{" in chat_template or "{%" in chat_template:
        return TemplateFormat(tokenizer, chat_template, "the chat template given inline")
    path = Path(chat_template)
    if path.is_file():
        return TemplateFormat(tokenizer, path.read_text(encoding="utf-8"), f"the chat template from {path}")
    raise MisconfigurationException(
        f"InstructionDataModule(chat_template={chat_template[:100]!r}) is neither 'auto', 'alpaca', a Jinja template"
        " (with `{{` or `{%`) nor an existing file. Give one of those, e.g. `chat_template: auto`."
    )


__all__ = ["ALPACA", "AUTO", "AlpacaFormat", "ChatFormat", "Segment", "TemplateFormat", "chat_format"]
