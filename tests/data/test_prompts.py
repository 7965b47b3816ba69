"""Prompts reach the engine exactly as the tokenizer's chat template (or the prompt
template) makes them."""
import pytest

from tests.support.bpe_model import TEXTS
from tlt_jax.data import tasks
from tlt_jax.data.prompts import PromptFormat, is_conversation
from tlt_jax.tokenizer import build_bpe_tokenizer, build_char_tokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return build_bpe_tokenizer(str(tmp_path_factory.mktemp("bpe")), TEXTS, vocab_size=400)


def test_chat_template_is_the_tokenizers_own_with_the_generation_prompt(bpe):
    fmt = PromptFormat(chat_template=True, system_prompt="Think step by step.")
    ids = fmt.ids(bpe, "What is 2 + 2?")
    messages = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2 + 2?"}]
    want = bpe.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(want)
    text = fmt.text(bpe, "What is 2 + 2?")
    assert bpe.decode(ids) == text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt: the model answers next
    assert text.startswith("<|im_start|>system\nThink step by step.<|im_end|>")


def test_a_conversation_goes_through_the_template_as_it_is(bpe):
    conversation = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                    {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Again."})
    assert is_conversation(conversation) and not is_conversation("Say hi.")
    fmt = PromptFormat(chat_template=True, system_prompt="ignored: the conversation has its own")
    want = bpe.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=False)
    assert fmt.text(bpe, conversation) == want
    with pytest.raises(ValueError, match="data.chat_template=True"):
        PromptFormat().text(bpe, conversation)


def test_prompt_template_formats_the_examples_fields(tmp_path):
    tok = tasks.build_task_tokenizer(str(tmp_path / "tok"))
    example = tasks.Example("add 1+2\n", "3=3\nanswer: 3", "3", "addition", {"a": 1, "b": 2})
    assert PromptFormat().example_ids(tok, example) == tok("add 1+2\n")["input_ids"]  # the default: as before
    fmt = PromptFormat(prompt_template="{prompt}add {b}+{a}\n")
    assert fmt.example_text(tok, example) == "add 1+2\nadd 2+1\n"
    with pytest.raises(ValueError, match="names the field 'c'"):
        PromptFormat(prompt_template="{c}").example_text(tok, example)
    with pytest.raises(ValueError, match="not a format string"):
        PromptFormat(prompt_template="{prompt").check(tok)


def test_chat_template_needs_a_tokenizer_that_has_one(tmp_path):
    tok = build_char_tokenizer(str(tmp_path / "char"), "abc")
    with pytest.raises(ValueError, match="has no chat template"):
        PromptFormat(chat_template=True).check(tok)
