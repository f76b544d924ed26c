"""Chat messages -> the prompt text a chat model was trained on, by its chat template.

One renderer for `jkv.chat` and the server's `/v1/chat/completions`: the template (Jinja, as
transformers and vLLM render it, in a sandbox) receives `messages`, `add_generation_prompt` and
the special tokens' strings (`bos_token`, `eos_token`). A model whose tokenizer has no template
gets `DEFAULT_CHAT_TEMPLATE`. A rendered chat is tokenised without adding special tokens: the
template places them.

Plain Python (jinja2 is imported where it renders): the server's wire-format module uses it.
"""

from __future__ import annotations

# The bos token, then each message on its own line as "role: content", then "assistant:" for
# the model to continue.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages) -> list[dict]:
    """The messages as a list of {"role", "content"} dicts of strings, or ValueError naming the
    first bad one."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"messages={messages!r:.80}: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]={m!r:.80}: expected a dict with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role={role!r}: expected one of {ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content={content!r:.60}: expected a string")
        out.append({"role": role, "content": content})
    return out


def render(
    messages: list[dict], template: str | None, special: dict[str, str],
    generation_prompt: bool = True,
) -> str:  # fmt: skip
    """The prompt text of a conversation by `template` (None: `DEFAULT_CHAT_TEMPLATE`), with the
    assistant turn's opening unless `generation_prompt` is False.

    Raises:
      ValueError: the template refused the messages (its `raise_exception`) or is broken.
    """
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template or DEFAULT_CHAT_TEMPLATE).render(
            messages=messages, add_generation_prompt=generation_prompt, **special
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template refused these messages: {e}") from None


def special_tokens(params) -> dict:
    """bos_token / eos_token as strings, by the model's ids (what chat templates call them)."""
    tok, cfg = params.tokenizer, params.config
    out = {}
    if tok is None:
        return out
    if cfg.bos_token_id is not None:
        out["bos_token"] = tok.id_to_token(cfg.bos_token_id) or ""
    if cfg.eos_token_ids:
        out["eos_token"] = tok.id_to_token(cfg.eos_token_ids[0]) or ""
    return out


def chat_prompt(params, messages) -> list[int]:
    """The token ids of a conversation rendered by the model's own chat template, ending with
    the assistant's turn for the model to write.

    Raises:
      ValueError: bad messages, a template that refuses them, or params without a tokenizer.
    """
    if params.tokenizer is None:
        raise ValueError("chat needs a tokenizer to render messages; these params carry none")
    text = render(check_messages(messages), params.tokenizer.chat_template, special_tokens(params))
    return params.tokenizer.encode(text, add_special_tokens=False)
