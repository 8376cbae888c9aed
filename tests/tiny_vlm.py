"""Tiny random-weight vision-language models built in-process with real processors (no downloads), and the
images they look at."""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_llava_processor():
    """A LLaVA processor over the tests' tiny BPE tokenizer (+ an <image> token) and a CLIP image processor:
    32x32 pixels, 8x8 patches, so 16 image tokens per image."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<image>"]})
    images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, chat_template=CHAT_TEMPLATE,
                          vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)


def build_llava(processor, seed: int = 0):
    """A LLaVA (CLIP vision tower, Llama language model) with random weights, the same for the same seed."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-1,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None  # references run their full length, as ignore_eos does
    return model


def build_idefics3_processor():
    """An Idefics3 (SmolVLM) processor: 32x32 tiles (an image larger than a tile is split into tiles plus a
    global view), 4 image tokens per tile."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<image>", "<fake_token_around_image>", "<global-img>"]})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                       do_image_splitting=True)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE)


def build_idefics3(processor, seed: int = 0):
    """An Idefics3 (SigLIP-style vision tower, pixel-shuffle connector, Llama language model), random weights."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig, LlamaConfig

    tokenizer = processor.tokenizer
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    return model


QWEN_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


def build_qwen2_vl_processor(class_name: str = "Qwen2VLProcessor"):
    """A Qwen2-VL (or Qwen2.5-VL) processor without its video side (which needs torchvision): 8x8 patches merged
    2x2, so an image's token count follows its size."""
    from transformers import Qwen2VLImageProcessorPil

    from tfserve.models.loading import images_only_processor_class
    from tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]})
    images = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    processor_class = images_only_processor_class(class_name)
    return processor_class(image_processor=images, tokenizer=tokenizer, video_processor=None,
                           chat_template=QWEN_TEMPLATE)


def build_qwen2_vl(processor, seed: int = 0):
    """A Qwen2-VL (its vision transformer, M-RoPE language model), random weights."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>")]}
    config = Qwen2VLConfig(
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 1024, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}},
        **ids)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def build_qwen2_5_vl(processor, seed: int = 0):
    """A Qwen2.5-VL (windowed vision attention, M-RoPE language model), random weights."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    qwen2 = build_qwen2_vl(processor, seed).config
    config = Qwen2_5_VLConfig(
        vision_config={"depth": 2, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                       "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                       "window_size": 32, "fullatt_block_indexes": [1]},
        text_config=qwen2.text_config.to_dict(), image_token_id=qwen2.image_token_id,
        video_token_id=qwen2.video_token_id, vision_start_token_id=qwen2.vision_start_token_id)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def build_gemma3_processor():
    """A Gemma 3 processor: one 32x32 view per image, pooled to 4 soft tokens between <start_of_image> and
    <end_of_image>."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    from tiny import build_tokenizer

    base = build_tokenizer()
    base.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]})
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>",
                                        unk_token="<unk>", extra_special_tokens={
                                            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                            "image_token": "<image_soft_token>"})
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<image>", "<start_of_image>")
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                           chat_template=tokenizer.chat_template)


def build_gemma3(processor, seed: int = 0):
    """A Gemma 3 (SigLIP tower, pooled projector; a text model with sliding and full layers), random weights
    drawn wide enough (initializer_range 0.3) that its image tokens' two-way attention shows in the logits."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = processor.tokenizer
    config = Gemma3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        text_config={"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "max_position_embeddings": 1024, "sliding_window": 8, "initializer_range": 0.3,
                     "layer_types": ["sliding_attention", "full_attention"], "eos_token_id": tokenizer.eos_token_id},
        mm_tokens_per_image=4, image_token_index=tokenizer.image_token_id, boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"), initializer_range=0.3)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


FAMILIES = {"llava": (build_llava_processor, build_llava), "idefics3": (build_idefics3_processor, build_idefics3),
            "qwen2_vl": (build_qwen2_vl_processor, build_qwen2_vl),
            "qwen2_5_vl": (lambda: build_qwen2_vl_processor("Qwen2_5_VLProcessor"), build_qwen2_5_vl),
            "gemma3": (build_gemma3_processor, build_gemma3)}


def save_vlm(model, processor, path) -> None:
    """A model directory as the hub has them: weights, config, processor (an images-only processor, which
    cannot save itself, as its image processor, tokenizer and a processor_config.json naming its class)."""
    import json

    model.save_pretrained(path)
    try:
        processor.save_pretrained(path)
    except AttributeError:
        processor.image_processor.save_pretrained(path)
        processor.tokenizer.chat_template = processor.chat_template
        processor.tokenizer.save_pretrained(path)
        (path / "processor_config.json").write_text(json.dumps({"processor_class": type(processor).__name__}))


def picture(seed: int, size: tuple[int, int] = (40, 48)):
    """A random RGB image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def image_message(text: str, num_images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(num_images)),
                                         {"type": "text", "text": text}]}]
