"""Images through the engine on a tiny random-weight LLaVA with a real processor: greedy tokens identical to the
model's own `generate` on the same pixels — one image, several, next to text-only requests, with chunked prefill
cutting through the image tokens, with preemption — and the prefix cache keyed by image content."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny import run_engine
from tiny_vlm import FAMILIES, image_message, picture, save_vlm

from tfserve.engine.engine import Engine
from tfserve.engine.multimodal import EncoderCache, ImageInput, MultiModalInput
from tfserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm(request):
    """One family's processor, its model builder, and the reference model (seed 0, the engines' weights too),
    left to transformers' own generate."""
    make_processor, build = FAMILIES[request.param]
    processor = make_processor()
    return SimpleNamespace(processor=processor, build=build, reference=build(processor))


def make_engine(vlm, **config):
    return Engine(vlm.build(vlm.processor), vlm.processor.tokenizer, processor=vlm.processor,
                  **{"num_blocks": 128, "block_size": 8, **config})


def expected(vlm, messages, images, max_new_tokens=8) -> list[int]:
    processor = vlm.processor
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    with torch.inference_mode():
        out = vlm.reference.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def run(engine, prompts) -> list:
    """Queue every (messages, images) at once; step until all finish; the generated tokens in order."""
    items = []
    for messages, images in prompts:
        if images:
            prompt_ids, mm = engine.render_multimodal(messages, images)
        else:
            prompt_ids, mm = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=True)["input_ids"], None
        items.append((prompt_ids, GREEDY, mm))
    return [output.generated_tokens for output in run_engine(engine, items)]


PROMPTS = [
    (image_message("What is this?"), [picture(1)]),
    (image_message("Compare them.", 2), [picture(2), picture(3, (64, 32))]),
    ([{"role": "user", "content": "No picture here."}], []),
    (image_message("And this one?"), [picture(4, (20, 80))]),
]


def test_render_expands_each_image_into_its_tokens(vlm):
    engine = make_engine(vlm)
    prompt_ids, mm = engine.render_multimodal(*PROMPTS[1])
    image_id = engine.vision.image_token_id
    first, second = mm.images
    assert prompt_ids.count(image_id) == first.num_tokens + second.num_tokens and first.num_tokens > 0
    assert all(prompt_ids[p] == image_id for s, e in first.spans + second.spans for p in range(s, e))
    assert first.spans[-1][1] <= second.spans[0][0] and first.key != second.key
    assert engine.render_multimodal(*PROMPTS[0])[1].images[0].key == engine.render_multimodal(
        image_message("Other words."), [picture(1)])[1].images[0].key  # the key is the image's, not the text's


@pytest.mark.parametrize("config", [{}, {"max_batch_tokens": 6}], ids=["whole", "chunked-through-images"])
def test_greedy_tokens_match_generate_in_a_mixed_batch(vlm, config):
    engine = make_engine(vlm, **config)
    got = run(engine, PROMPTS)
    for (messages, images), tokens in zip(PROMPTS, got):
        assert tokens == expected(vlm, messages, images), messages
    assert engine.vision.cache.num_encoded == 4  # each image once
    if not config:  # the four images' prefills share one step: their encodes are batched
        assert engine.vision.cache.num_encoder_calls < 4


def test_every_prompt_position_matches_the_reference_logits(vlm):
    """The prefill itself, position by position (prompt logprobs), not only the argmax after it: each family's
    image attention, Gemma 3's two-way image tokens included, gives the reference's log-probabilities, also
    when chunks cut the prompt."""
    engine = make_engine(vlm, max_batch_tokens=6)
    messages, images = PROMPTS[1]
    prompt_ids, mm = engine.render_multimodal(messages, images)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3, prompt_logprobs=3)
    (request,) = engine.make_requests(prompt_ids, params, mm=mm)
    engine.enqueue(request)
    outputs = [o for _ in range(200) if engine.has_unfinished for o in engine.step() if o.finished]
    text = vlm.processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = vlm.processor(text=[text], images=[images], return_tensors="pt")
    with torch.inference_mode():
        want = vlm.reference(**inputs).logits[0].log_softmax(-1)  # [num_prompt_tokens, vocab]
    entries = outputs[0].prompt_logprobs[1:] + [outputs[0].logprobs[0]]  # position p predicts token p + 1
    assert len(entries) == len(prompt_ids)
    for position, entry in enumerate(entries):
        values, ids = want[position].topk(3)
        assert [token for token, _ in entry["top"]] == ids.tolist(), position
        assert [value for _, value in entry["top"]] == pytest.approx(values.tolist(), abs=1e-4), position


def test_preemption_recomputes_without_encoding_again(vlm):
    prompts = [(image_message(f"Picture {i}?"), [picture(10 + i)]) for i in range(4)]
    longest = max(len(make_engine(vlm).render_multimodal(*p)[0]) for p in prompts)
    block_size = 4
    num_blocks = -(-(longest + GREEDY.max_tokens) // block_size) + 2  # one request fits, four do not
    engine = make_engine(vlm, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=16)
    got = run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    for (messages, images), tokens in zip(prompts, got):
        assert tokens == expected(vlm, messages, images)
    assert engine.vision.cache.num_encoded == 4  # recomputes took their features from the encoder cache


def test_the_prefix_cache_hits_on_the_same_image_and_misses_on_another(vlm):
    engine = make_engine(vlm)
    size = engine.block_pool.block_size
    messages = image_message("Describe the picture in detail.")
    _, mm = engine.render_multimodal(messages, [picture(5)])
    image_start, image_end = mm.images[0].spans[0][0], mm.images[0].spans[-1][1]
    first = run(engine, [(messages, [picture(5)])])
    hits = engine.block_pool.stats.num_hit_tokens
    again = run(engine, [(messages, [picture(5)])])
    assert again == first and engine.block_pool.stats.num_hit_tokens - hits >= image_end // size * size
    hits = engine.block_pool.stats.num_hit_tokens
    other = run(engine, [(messages, [picture(6)])])
    assert engine.block_pool.stats.num_hit_tokens - hits <= image_start // size * size  # nothing past the image
    assert other == [expected(vlm, messages, [picture(6)])]


def test_images_that_do_not_fit_are_value_errors(vlm):
    engine = make_engine(vlm)
    with pytest.raises(ValueError):  # more images than placeholders: the processor or our count says so
        engine.render_multimodal(image_message("One placeholder."), [picture(1), picture(2)])


def test_a_text_model_refuses_images(text_tokenizer):
    from tiny import build_llama

    engine = Engine(build_llama(text_tokenizer), text_tokenizer, num_blocks=16)
    assert engine.input_modalities == ["text"]
    mm = MultiModalInput((ImageInput(((0, 2),), "k", {}),))
    with pytest.raises(ValueError, match="does not take images"):
        engine.make_requests([1, 2, 3], GREEDY, mm=mm)
    with pytest.raises(ValueError, match="does not take images"):
        engine.render_multimodal(image_message("x"), [picture(1)])


@pytest.fixture(scope="module")
def text_tokenizer():
    from tiny import build_tokenizer

    return build_tokenizer()


def test_block_hashes_name_the_images_a_block_holds():
    from tfserve.engine.kv_cache import BlockPool
    from tfserve.engine.request import Request

    def hashes(key):
        request = Request("r", list(range(12)), GREEDY, mm=MultiModalInput((ImageInput(((4, 8),), key, {}),)))
        pool = BlockPool(8, 4)
        pool._hash_full_blocks(request, 12)
        return request.block_hashes

    text = Request("t", list(range(12)), GREEDY)
    BlockPool(8, 4)._hash_full_blocks(text, 12)
    a, b = hashes("a"), hashes("b")
    assert a[0] == b[0] == text.block_hashes[0]  # before the image: plain text blocks
    assert a[1] != b[1] and a[2] != b[2] and a[1] != text.block_hashes[1]


def test_encoder_cache_drops_the_least_recently_used():
    row = torch.zeros(4, 8)  # 128 bytes
    cache = EncoderCache(max_bytes=300)
    cache.put("a", row)
    cache.put("b", row.clone())
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", row.clone())
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 2


def test_image_rows_follow_their_spans():
    image = ImageInput(((2, 4), (6, 9)), "k", {})
    assert image.num_tokens == 5
    assert image.rows_in(0, 100) == [(2, 0), (3, 1), (6, 2), (7, 3), (8, 4)]
    assert image.rows_in(3, 7) == [(3, 1), (6, 2)]
    assert MultiModalInput((image,)).keys_in(4, 6) == () and MultiModalInput((image,)).keys_in(4, 7) == ("k",)


def test_a_vision_language_directory_loads_with_its_processor(vlm, tmp_path):
    save_vlm(vlm.build(vlm.processor), vlm.processor, tmp_path)
    engine = Engine.from_pretrained(str(tmp_path), num_blocks=64, block_size=8, cpu_kernels=False)
    assert engine.input_modalities == ["text", "image"] and engine.processor is not None
    assert type(engine.model) is type(vlm.reference)
    assert run(engine, PROMPTS[:1]) == [expected(vlm, *PROMPTS[0])]
    from tfserve.models.store import model_info

    info = model_info(str(tmp_path))
    assert "2 layers" in info.vision_tower and "32 wide" in info.vision_tower
    assert info.image_tokens.startswith(("16 per image", "4 per tile", "by image size", "4 per image"))


def test_a_bidirectional_image_is_never_cut_by_a_chunk():
    image = ImageInput(((10, 14),), "k", {})
    both_ways = MultiModalInput((image,), bidirectional=True)
    assert both_ways.chunk_size(0, 12) == 10  # would end inside: stop before the image
    assert both_ways.chunk_size(10, 2) == 4 and both_ways.chunk_size(12, 1) == 2  # from inside it: to its end
    assert both_ways.chunk_size(0, 20) == 20 and both_ways.chunk_size(0, 10) == 10
    assert MultiModalInput((image,)).chunk_size(0, 12) == 12  # one-way images are cut anywhere
    assert both_ways.runs_in(0, 11) == [(10, 14)] and both_ways.runs_in(14, 20) == []


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl"])  # images through inputs_embeds, 3-D rotary positions every step
def test_the_compiled_forward_takes_images_in_the_graph_compiled_at_load(family):
    from torch._dynamo.utils import counters

    make_processor, build = FAMILIES[family]
    processor = make_processor()
    vlm = SimpleNamespace(processor=processor, build=build, reference=build(processor))
    before = counters["stats"]["unique_graphs"]
    engine = make_engine(vlm, compile=True)
    assert engine.runner.forward.name == "compiled" and counters["stats"]["unique_graphs"] == before + 1
    assert run(engine, PROMPTS) == [expected(vlm, *prompt) for prompt in PROMPTS]
    assert counters["stats"]["unique_graphs"] == before + 1  # no request compiled another
