"""The character tokenizer: fixed special ids, exact round trips, offline AutoTokenizer loading."""
import pytest
import transformers

from tlt_jax import tokenizer as tk

ALPHABET = "0123456789+-=*/ .,?\nabcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tk.build_char_tokenizer(str(tmp_path_factory.mktemp("tok")), ALPHABET,
                                   extra_special_tokens=("<think>", "</think>"))


def test_ids_and_round_trip(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<think>", "</think>", "0"]) == [4, 5, 6]
    assert len(tok) == 6 + len(ALPHABET)
    text = "what is 12 + 30 ?\n<think>12 + 30 = 42 .</think> 42 , done"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(4) == 1 and ids.count(5) == 1
    assert len(ids) == 1 + len(text) - len("<think></think>") + 2  # one id per character or marker
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + text
    assert tok.decode(ids[1:]) == text  # spaces before punctuation are kept
    assert tok("ab", add_special_tokens=False)["input_ids"] == tok.convert_tokens_to_ids(["a", "b"])


def test_unknown_characters_and_padding(tok):
    assert tok("aZb", add_special_tokens=False)["input_ids"][1] == tok.unk_token_id
    batch = tok(["ab", "abcd"], padding=True)["input_ids"]
    assert batch[0][-2:] == [tok.pad_token_id] * 2 and len(batch[0]) == len(batch[1])


def test_saved_directory_loads_offline_with_auto_tokenizer(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = str(tmp_path / "t")
    tk.build_char_tokenizer(path, "ab", add_bos=False)
    loaded = transformers.AutoTokenizer.from_pretrained(path)
    assert loaded("abba")["input_ids"] == [4, 5, 5, 4]
    assert loaded.decode([4, 5, 2], skip_special_tokens=True) == "ab"


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="single characters"):
        tk.build_char_tokenizer(str(tmp_path / "x"), ["a", "bc"])
    with pytest.raises(FileNotFoundError):
        tk.load_tokenizer(str(tmp_path / "missing"))
