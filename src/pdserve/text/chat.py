"""Chat templates: a checkpoint's Jinja template rendered over a list of
messages, in the sandboxed environment transformers uses, so the same
messages give the same text (and so the same token ids)."""

from __future__ import annotations

import functools
import json
from datetime import datetime


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


CONTINUE_MARK = "\x00pdserve: the final message ends here\x00"


def render_chat(template: str | None, messages: list, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                continue_final_message: bool = False, **extra) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).
    With `continue_final_message` the text stops right after the last
    message's content, so the model carries that message on instead of
    closing its turn (what transformers and vLLM do). A missing template, or
    one that fails on these messages, is a ValueError that says which."""
    if not template:
        raise ValueError("this model has no chat template; send a plain prompt instead of "
                         "chat messages")
    import jinja2

    if continue_final_message:       # where the content ends: a mark no template writes
        content = messages[-1].get("content") or ""
        messages = [*messages[:-1], {**messages[-1], "content": content + CONTINUE_MARK}]
    try:
        text = _compile(template).render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra)
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template failed on these messages: {e}") from None
    if continue_final_message:
        end = text.rfind(CONTINUE_MARK)
        if end < 0:
            raise ValueError("continue_final_message: the chat template does not write the "
                             "last message's content out as given")
        text = text[:end]
    return text
