"""configs/distill.py's presets: the defaults the cache ranking supports (docs/results.md,
"Teacher caches ranked"), and the example preset distils the README's example model on the
data and format it was SFT-trained on."""
from configs import distill, sft


def test_the_default_cache_is_sampled_at_a_top_k_caches_bytes_and_the_32k_preset_keeps_the_papers():
    c = distill.get_config("tiny")
    assert (c.cache_kind, c.tail) == ("sampled", True)
    assert c.cache_samples == c.top_k  # equal bytes: the ranking's comparison
    assert distill.get_config("llama3-8b-to-3b-32k").cache_kind == "topk"  # what its memory plan covers
    # The sweep compares the two top-K losses; a sampled cache has no tail bucket to compare.
    assert {point["cache_kind"] for point in distill.get_sweep()} == {"topk"}


def test_the_example_preset_reads_the_sft_examples_model_in_its_format():
    c, teacher = distill.get_config("example"), sft.get_config("example")
    assert c.teacher_dir == f"{teacher.run_dir}/hf"
    for field in ("source", "chat_template", "seq_len", "prompt_template", "system_prompt", "seed"):
        assert c.data[field] == teacher.data[field], field
    assert c.data.num_eval >= teacher.data.num_eval
