"""Images in (issue 16, the request side): image parts of chat completions and the Responses API -> decoded
images handed to the engine's `render_multimodal` (faked here on the tiny engine: the real one is the engine's),
and every bad image, URL, file or limit a 400 naming its content part."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import time
import zlib

import pytest
from aiohttp import web
from PIL import Image

from tiny import MODEL_NAME

from tfserve.images import ImageError, data_url_bytes, decode_image
from tfserve.protocol.chat_template import render_chat
from tfserve.server.media import MediaOptions
from tfserve.server.media_fetch import is_public

CHAT = "/v1/chat/completions"
RED, BLUE = (255, 0, 0), (0, 0, 255)


def encode(fmt: str, size=(8, 6), color=RED, mode="RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color).save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` and holds no pixels: what a decompression bomb's header says."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def chat_body(*parts, text: str = "What is this?") -> dict:
    content = [{"type": "text", "text": text}, *parts]
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0}


class Vision:
    """The tiny engine dressed as a vision-language model: a vision side, and a `render_multimodal` that records
    what it was given and renders the text through the chat template."""

    def __init__(self, engine, monkeypatch) -> None:
        self.calls: list[dict] = []
        self.mm_seen: list = []
        self.threads: list[str] = []
        self.fail_with: Exception | None = None
        real_make_requests = engine.make_requests
        tokenizer = engine.tokenizer

        def render_multimodal(messages, images, *, tools=None, template_kwargs=None, add_generation_prompt=True,
                              continue_final_message=False):
            self.calls.append({"messages": messages, "images": images, "tools": tools})
            self.threads.append(threading.current_thread().name)
            if self.fail_with is not None:
                raise self.fail_with
            flat = [{**m, "content": "".join(p.get("text", "<image>") for p in m["content"])}
                    if isinstance(m["content"], list) else m for m in messages]
            ids = render_chat(tokenizer, flat, tools, template_kwargs, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message)
            return ids, {"sha256": [image.sha256 for image in images]}

        def make_requests(prompt, params=None, request_id=None, **kwargs):
            self.mm_seen.append(kwargs.get("mm"))
            return real_make_requests(prompt, params, request_id)

        monkeypatch.setattr(engine, "vision", object())  # input_modalities: text and image
        monkeypatch.setattr(engine, "render_multimodal", render_multimodal, raising=False)
        monkeypatch.setattr(engine, "make_requests", make_requests)

    @property
    def images(self) -> list:
        return self.calls[-1]["images"]


@pytest.fixture
def vision(engine, monkeypatch) -> Vision:
    return Vision(engine, monkeypatch)


class FileServer:
    """Images over HTTP on 127.0.0.1: /cat.png, a 404, a slow one, big ones (with and without Content-Length),
    redirects."""

    def __init__(self, cat: bytes) -> None:
        async def slow(request):
            await asyncio.sleep(5)
            return web.Response(body=cat)

        async def big(request):  # no Content-Length: the cap must hold while reading
            response = web.StreamResponse()
            await response.prepare(request)
            for _ in range(64):
                await response.write(b"\0" * 1024)
            return response

        async def image(request):
            return web.Response(body=cat, content_type="image/png")

        async def large(request):  # says how big it is up front
            return web.Response(body=b"\0" * 64 * 1024, content_type="image/png")

        async def redirect(request):
            raise web.HTTPFound(request.query.get("to", "/cat.png").replace("PORT", str(self.port)))

        app = web.Application()
        app.router.add_get("/cat.png", image)
        app.router.add_get("/slow.png", slow)
        app.router.add_get("/big.png", big)
        app.router.add_get("/large.png", large)
        app.router.add_get("/redirect", redirect)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            runner = web.AppRunner(app, shutdown_timeout=0.1)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner

        self.runner = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def files():
    server = FileServer(encode("PNG", (5, 4)))
    yield server
    server.close()


def post_error(live, body, path=CHAT) -> tuple[str, str]:
    status, _, answer = live.request("POST", path, body)
    assert status == 400, answer
    return answer["error"]["param"], answer["error"]["message"]


# -- decoding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("GIF", "image/gif")])
def test_each_format_decodes_to_rgb_of_its_size(fmt, mime):
    image = decode_image(data_url_bytes(data_url(encode(fmt, (9, 7)), mime)), "here")
    assert image.image.mode == "RGB" and image.image.size == (9, 7) and image.where == "here"
    red, green, blue = image.image.getpixel((4, 3))
    assert red > 200 and green < 60 and blue < 60


def test_a_gif_is_its_first_frame_and_transparency_becomes_white():
    frames = [Image.new("RGB", (4, 4), color) for color in (BLUE, RED)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buffer.getvalue()).image.getpixel((0, 0)) == BLUE
    clear = decode_image(encode("PNG", (3, 3), (0, 0, 0, 0), mode="RGBA"))
    assert clear.image.getpixel((1, 1)) == (255, 255, 255)


def test_the_hash_is_of_the_pixels_not_the_file():
    png, webp = decode_image(encode("PNG", (6, 6))), decode_image(encode("WEBP", (6, 6)))
    assert png.sha256 == webp.sha256 and len(png.sha256) == 64
    assert decode_image(encode("PNG", (6, 6), BLUE)).sha256 != png.sha256
    assert decode_image(encode("PNG", (4, 9))).sha256 != decode_image(encode("PNG", (9, 4))).sha256


@pytest.mark.parametrize("address,public", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("192.168.0.1", False), ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("::1", False),
    ("fe80::1%eth0", False), ("fc00::1", False), ("::ffff:127.0.0.1", False), ("2002:7f00:1::", False),
    ("224.0.0.1", False),
])
def test_which_addresses_are_public(address, public):
    assert is_public(address) is public


# -- the happy path --------------------------------------------------------------------------------------------


def test_images_reach_the_engine_in_order_with_hf_parts(server, vision):
    first, second = encode("PNG", (3, 2)), encode("JPEG", (5, 4), BLUE)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, image_part(data_url(first)),
                                     {"type": "text", "text": " with"}]},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": [image_part(data_url(second, "image/jpeg"), detail="low")]},
    ]
    status, _, answer = server.request("POST", CHAT, {"model": MODEL_NAME, "messages": messages, "max_tokens": 2})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] is not None
    (call,) = vision.calls
    assert [image.image.size for image in call["images"]] == [(3, 2), (5, 4)]
    assert [image.where for image in call["images"]] == ["messages[1].content[1]", "messages[3].content[0]"]
    assert call["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                     {"type": "text", "text": " with"}]},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    assert vision.mm_seen == [{"sha256": [image.sha256 for image in call["images"]]}]
    assert all(name != "MainThread" for name in vision.threads)


def test_text_requests_are_what_they_were(server, vision):
    from tfserve.server.requests.chat import parse_messages

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "developer", "content": "c"}]}
    messages = parse_messages(body["messages"])
    assert (messages.rendered, messages.image_refs) == ([{"role": "user", "content": "ab"},
                                                         {"role": "system", "content": "c"}], [])
    status, _, _ = server.request("POST", CHAT, {**body, "model": MODEL_NAME, "max_tokens": 2})
    assert status == 200 and vision.calls == [] and vision.mm_seen == [None]


def test_decoding_runs_off_the_event_loop(server, vision, monkeypatch):
    from tfserve.server import media

    threads = []
    real = media.decode_image

    def spy(*args):
        threads.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(media, "decode_image", spy)
    status, _, _ = server.request("POST", CHAT, chat_body(image_part(data_url(encode("PNG")))))
    assert status == 200 and threads and server.thread not in threads


def test_responses_input_image(server, vision):
    image = {"type": "input_image", "image_url": data_url(encode("PNG", (7, 3))), "detail": "high"}
    body = {"model": MODEL_NAME, "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe"}, image]}]}
    status, _, answer = server.request("POST", "/v1/responses", body)
    assert status == 200, answer
    assert vision.calls[0]["messages"][-1] == {"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                                           {"type": "image"}]}
    assert [image.image.size for image in vision.images] == [(7, 3)]
    # the next turn of the stored conversation brings its image back, then the new one
    gif = {"type": "input_image", "image_url": data_url(encode("GIF", (2, 2)), "image/gif")}
    follow = {"model": MODEL_NAME, "max_output_tokens": 2, "previous_response_id": answer["id"],
              "input": [{"role": "user", "content": [gif]}]}
    status, _, answer = server.request("POST", "/v1/responses", follow)
    assert status == 200, answer
    assert [image.image.size for image in vision.images] == [(7, 3), (2, 2)]
    assert [image.where for image in vision.images] == ["previous_response_id", "input[0].content[0]"]
    assert vision.mm_seen[-1] == {"sha256": [image.sha256 for image in vision.images]}


def test_a_text_model_reports_text_input(server):
    status, _, listing = server.request("GET", "/v1/models")
    assert listing["data"][0]["input_modalities"] == ["text"]


def test_a_real_vision_model_answers_about_the_image():
    """Through HTTP on a tiny random-weight LLaVA with its real processor: the reply is the engine's own greedy
    answer on the same pixels (PNG is lossless), and /v1/models says it takes images."""
    from tiny_vlm import build_llava, build_llava_processor, image_message, picture

    from tfserve.engine.async_engine import AsyncEngine
    from tfserve.engine.engine import Engine
    from tfserve.sampling_params import SamplingParams
    from tiny import LiveServer, make_state

    processor = build_llava_processor()
    engine = Engine(build_llava(processor), processor.tokenizer, processor=processor, num_blocks=64, block_size=8)
    image = picture(3)
    prompt_ids, mm = engine.render_multimodal(image_message("What is it?"), [image])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (request,) = engine.make_requests(prompt_ids, greedy, mm=mm)
    engine.enqueue(request)
    while engine.has_unfinished:
        outputs = [output for output in engine.step() if output.finished]
    expected = outputs[0].text
    async_engine = AsyncEngine(engine).start()
    live = LiveServer(make_state(async_engine))
    try:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        content = [image_part(data_url(buffer.getvalue())), {"type": "text", "text": "What is it?"}]
        answer = live.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=6,
            extra_body={"ignore_eos": True})
        assert answer.choices[0].message.content == expected
        assert answer.usage.prompt_tokens == len(prompt_ids)
        status, _, listing = live.request("GET", "/v1/models")
        assert listing["data"][0]["input_modalities"] == ["text", "image"]
    finally:
        live.close()
        async_engine.stop()


# -- refusals ---------------------------------------------------------------------------------------------------


def test_a_text_only_model_refuses_images(server):
    param, message = post_error(server, chat_body(image_part(data_url(encode("PNG")))))
    assert param == "messages[0].content[1]" and f"the model {MODEL_NAME} does not take images" in message


BMP = encode("BMP")


@pytest.mark.parametrize("part,param,words", [
    (image_part(data_url(b"not an image at all")), "messages[0].content[1]", "not a PNG, JPEG, WebP or GIF"),
    (image_part(data_url(png_header(10, 10))), "messages[0].content[1]", "cannot decode"),
    (image_part(data_url(BMP, "image/bmp")), "messages[0].content[1]", "unsupported image type 'image/bmp'"),
    (image_part(data_url(BMP)), "messages[0].content[1]", "not a PNG, JPEG, WebP or GIF"),
    (image_part("data:image/png;base64,iVBOR*w0KGgo="), "messages[0].content[1]", "base64 is invalid"),
    (image_part("data:image/png,rawbytes"), "messages[0].content[1]", "must be base64"),
    (image_part(data_url(png_header(30_000, 30_000))), "messages[0].content[1]", "megapixels"),
    (image_part("/etc/hosts.png"), "messages[0].content[1]", "data: URL"),
    (image_part("ftp://example.com/x.png"), "messages[0].content[1]", "data: URL"),
    (image_part(data_url(encode("PNG")), detail="ultra"), "messages[0].content[1].image_url.detail", "auto"),
    ({"type": "image_url", "image_url": {}}, "messages[0].content[1].image_url.url", "required"),
    ({"type": "image_url"}, "messages[0].content[1].image_url", "required"),
])
def test_bad_images_are_400s_naming_the_part(server, vision, part, param, words):
    got, message = post_error(server, chat_body(part))
    assert got == param and words in message, message


def test_limits_on_bytes_pixels_and_count(start_server, vision):
    live = start_server(state_kwargs={"media": MediaOptions(max_image_bytes=300, max_image_pixels=400,
                                                            max_images=2)})
    param, message = post_error(live, chat_body(image_part(data_url(b"\0" * 600))))
    assert param == "messages[0].content[1]" and "is 600 bytes; at most 300 bytes" in message
    param, message = post_error(live, chat_body(image_part(data_url(encode("PNG", (21, 20))))))
    assert param == "messages[0].content[1]" and "21x20" in message
    small = image_part(data_url(encode("PNG", (2, 2))))
    body = chat_body(small, small)
    body["messages"].append({"role": "user", "content": [small]})
    param, message = post_error(live, body)
    assert param == "messages[1].content[0]" and "at most 2 images" in message
    assert vision.calls == []  # refused before anything was fetched or rendered


def test_pillows_decompression_bomb_guard_is_a_400(start_server, vision):
    live = start_server(state_kwargs={"media": MediaOptions(max_image_pixels=10**11)})  # only Pillow's guard left
    param, message = post_error(live, chat_body(image_part(data_url(png_header(90_000, 90_000)))))
    assert param == "messages[0].content[1]" and "megapixels" in message


def test_the_engines_own_refusal_names_the_first_image(server, vision):
    vision.fail_with = ValueError("this model takes at most 1 image per prompt")
    image = image_part(data_url(encode("PNG")))
    param, message = post_error(server, chat_body(image, image))
    assert param == "messages[0].content[1]" and message.startswith("messages[0].content[1]: ")
    assert "at most 1 image" in message


def test_responses_refusals(server, vision):
    def body(part):
        content = [{"type": "input_text", "text": "x"}, part]
        return {"model": MODEL_NAME, "input": [{"role": "user", "content": content}]}

    param, message = post_error(server, body({"type": "input_image", "file_id": "file-123"}), "/v1/responses")
    assert param == "input[0].content[1].file_id" and "not supported" in message
    param, _ = post_error(server, body({"type": "input_image", "image_url": data_url(b"junk")}), "/v1/responses")
    assert param == "input[0].content[1]"


# -- URLs and files ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "[::ffff:127.0.0.1]", "0.0.0.0",
                                  "2130706433", "127.1", "0x7f.0.0.1"])
def test_private_addresses_are_refused_without_an_allow_list(server, vision, files, host):
    param, message = post_error(server, chat_body(image_part(f"http://{host}:{files.port}/cat.png")))
    assert param == "messages[0].content[1]"
    assert "private or reserved address" in message or "not a canonical IPv4 address" in message, message


@pytest.fixture
def allowed(start_server, vision):
    media = MediaOptions(allowed_domains=("127.0.0.1",), fetch_timeout_s=0.5, max_image_bytes=32 * 1024)
    return start_server(state_kwargs={"media": media})


def test_an_allowed_domain_is_fetched_with_redirects(allowed, vision, files):
    status, _, answer = allowed.request("POST", CHAT, chat_body(image_part(f"{files.url}/cat.png"),
                                                                image_part(f"{files.url}/redirect")))
    assert status == 200, answer
    assert [image.image.size for image in vision.images] == [(5, 4), (5, 4)]


@pytest.mark.parametrize("path,words", [
    ("/missing.png", "HTTP 404"),
    ("/big.png", "more than 32 KiB"),
    ("/large.png", "is 64 KiB; at most 32 KiB"),
    ("/redirect?to=http://localhost:PORT/cat.png", "localhost is not among the server's --allowed-media-domains"),
])
def test_failed_fetches_are_400s(allowed, files, path, words):
    param, message = post_error(allowed, chat_body(image_part(f"{files.url}{path}")))
    assert param == "messages[0].content[1]" and words in message, message


def test_a_slow_fetch_times_out(allowed, files):
    start = time.monotonic()
    param, message = post_error(allowed, chat_body(image_part(f"{files.url}/slow.png")))
    assert param == "messages[0].content[1]" and "longer than 0.5 s" in message
    assert time.monotonic() - start < 3


def test_file_urls_only_under_the_allowed_path(start_server, server, vision, tmp_path):
    media_dir, outside = tmp_path / "media", tmp_path / "secret.png"
    media_dir.mkdir()
    (media_dir / "cat.png").write_bytes(encode("PNG", (6, 2)))
    outside.write_bytes(encode("PNG"))
    (media_dir / "link.png").symlink_to(outside)
    param, message = post_error(server, chat_body(image_part((media_dir / "cat.png").as_uri())))
    assert param == "messages[0].content[1]" and "--allowed-local-media-path" in message
    live = start_server(state_kwargs={"media": MediaOptions(allowed_local_path=media_dir)})
    status, _, answer = live.request("POST", CHAT, chat_body(image_part((media_dir / "cat.png").as_uri())))
    assert status == 200, answer
    assert vision.images[0].image.size == (6, 2)
    for url in [f"file://{media_dir}/../secret.png", (media_dir / "link.png").as_uri(), "file:///etc/passwd"]:
        param, message = post_error(live, chat_body(image_part(url)))
        assert param == "messages[0].content[1]" and "outside" in message, url
    param, message = post_error(live, chat_body(image_part((media_dir / "nope.png").as_uri())))
    assert "cannot read" in message


def test_media_options_check_their_fields(tmp_path):
    with pytest.raises(ValueError, match="max_images"):
        MediaOptions(max_images=0)
    with pytest.raises(ValueError, match="allowed_local_path"):
        MediaOptions(allowed_local_path=tmp_path / "missing")
    assert MediaOptions(allowed_domains=(" Example.COM. ",)).allowed_domains == ("example.com",)
    with pytest.raises(ImageError, match="at most"):
        data_url_bytes(data_url(b"x" * 100), max_bytes=10)
