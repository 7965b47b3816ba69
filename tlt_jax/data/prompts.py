"""Prompts as the model expects them: the tokenizer's own chat template, or a format string.

`PromptFormat` turns an example's prompt into the exact token ids the rollout engine
receives and the learner scores, and into their text (what a person reads in
`eval_samples.jsonl`):

  chat_template=True    the tokenizer's chat template over the conversation, with the
                        generation prompt (`apply_chat_template(messages,
                        add_generation_prompt=True)`); a text prompt becomes one user
                        message (through `prompt_template`), preceded by a system message
                        when `system_prompt` is set; a prompt that is already a
                        conversation (a list of {role, content}) goes through as it is.
  chat_template=False   `prompt_template.format(prompt=..., **fields)` tokenized as plain
                        text, with the tokenizer's own special tokens (a <bos> where it
                        adds one). The default "{prompt}" is the synthetic tasks' format.
"""
from __future__ import annotations

import dataclasses
import string
from typing import Any, Mapping, Sequence

Message = Mapping[str, str]


def is_conversation(prompt: Any) -> bool:
    """Whether a prompt is a list of {role, content} messages (not plain text)."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt))


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    chat_template: bool = False
    system_prompt: str = ""
    prompt_template: str = "{prompt}"

    @classmethod
    def from_config(cls, data_config) -> PromptFormat:
        """From a config's `data` section (its chat_template, system_prompt and
        prompt_template; absent fields keep the defaults)."""
        get = data_config.get
        return cls(chat_template=bool(get("chat_template", False)), system_prompt=get("system_prompt", "") or "",
                   prompt_template=get("prompt_template", "{prompt}") or "{prompt}")

    def check(self, tokenizer) -> None:
        """Raises ValueError naming the field when this format cannot be applied."""
        if self.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.chat_template=True but the tokenizer has no chat template (no chat_template in "
                             "its tokenizer_config.json or chat_template.jinja); set data.chat_template=False and "
                             "give data.prompt_template, or use the checkpoint's instruct tokenizer.")
        try:
            list(string.Formatter().parse(self.prompt_template))
        except ValueError as e:
            raise ValueError(f"data.prompt_template={self.prompt_template!r} is not a format string over the "
                             f"example's fields ({e}); write fields as {{prompt}}, {{question}}, ...") from e

    def _user_text(self, prompt: str, fields: Mapping[str, Any]) -> str:
        try:
            return self.prompt_template.format(**{**fields, "prompt": prompt})
        except KeyError as e:
            raise ValueError(f"data.prompt_template={self.prompt_template!r} names the field {e}, which the example "
                             f"does not have; its fields: {sorted({'prompt', *fields})}.") from e

    def messages(self, prompt: str | Sequence[Message], fields: Mapping[str, Any] = ()) -> list[dict]:
        """The conversation given to the chat template."""
        if is_conversation(prompt):
            messages = [dict(m) for m in prompt]
        else:
            messages = [{"role": "user", "content": self._user_text(prompt, dict(fields))}]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def text(self, tokenizer, prompt: str | Sequence[Message], fields: Mapping[str, Any] = ()) -> str:
        """The prompt as text, exactly as tokenized (the chat template's special tokens included)."""
        if self.chat_template:
            return tokenizer.apply_chat_template(self.messages(prompt, fields), add_generation_prompt=True,
                                                 tokenize=False)
        if is_conversation(prompt):
            raise ValueError("The prompt is a conversation (a list of {role, content} messages) but "
                             "data.chat_template=False; set data.chat_template=True to format it with the "
                             "tokenizer's chat template.")
        return self._user_text(prompt, dict(fields))

    def ids(self, tokenizer, prompt: str | Sequence[Message], fields: Mapping[str, Any] = ()) -> list[int]:
        """The prompt's token ids: what the engine receives and the learner scores."""
        if self.chat_template:
            out = tokenizer.apply_chat_template(self.messages(prompt, fields), add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
            return list(out["input_ids"])
        return list(tokenizer(self.text(tokenizer, prompt, fields))["input_ids"])

    def example_ids(self, tokenizer, example) -> list[int]:
        """`ids` of a `tasks.Example` (its prompt and fields)."""
        return self.ids(tokenizer, example.prompt, example.fields)

    def example_text(self, tokenizer, example) -> str:
        return self.text(tokenizer, example.prompt, example.fields)

