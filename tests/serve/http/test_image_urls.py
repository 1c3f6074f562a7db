"""Chat images by URL (serve/http/image_urls.py): off by default (a 400 naming the part and the config key); on,
only allowed hosts, never a non-public address after DNS, no redirect to another host, size and time caps, GIF as
its first frame, and the fetched image priced like a data: URL's.

The test server listens on 127.0.0.1, itself a loopback address: the SSRF refusal is tested against it as it is,
and the allowed path through a resolver that maps made-up allowed domains to it, with `allow_loopback_for_tests`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from schemas.api import AnswerRequest
from schemas.config import ImageUrlsSpec
from schemas.errors import InvalidRequestError
from serve.app import api_spec
from serve.config import AppConfig
from serve.http import make_api
from serve.http.image_urls import ImageFetcher, public_address, system_resolve
from serve.local import InProcessBackend
from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.serve.http.test_chat_conversations import NO_CACHE, data_url
from tests.support.store_factory import MAX_CHUNKS, roles, serving_store  # noqa: F401  (fixtures)
from tests.support.tls_certs import tls_pair

PARAM = "messages[0].content[0].image_url"
CAP = 4096  # the tests' max_bytes


def png(color: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buffer, "PNG")
    return buffer.getvalue()


def animated_gif() -> bytes:
    """Two frames: red, then blue."""
    buffer = io.BytesIO()
    frames = [Image.new("RGB", (32, 32), color) for color in ("red", "blue")]
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buffer.getvalue()


class Site(BaseHTTPRequestHandler):
    hits: list[tuple[str, str]] = []  # (path, Host header) of every request the server answered

    def do_GET(self):  # noqa: N802  (http.server's name)
        Site.hits.append((self.path, self.headers.get("Host", "")))
        port = self.server.server_address[1]
        if self.path == "/red.png":
            self.reply(200, png("red"), "image/png")
        elif self.path == "/anim.gif":
            self.reply(200, animated_gif(), "image/gif")
        elif self.path == "/text":
            self.reply(200, b"not an image", "text/plain")
        elif self.path == "/same-host":
            self.redirect("/red.png")
        elif self.path == "/other-host":
            self.redirect(f"http://elsewhere.test:{port}/red.png")
        elif self.path == "/loop":
            self.redirect("/loop")
        elif self.path == "/declared-big":
            self.send_response(200)
            self.send_header("Content-Length", str(CAP * 100))
            self.end_headers()  # and no body: the fetch must refuse on the header alone
        elif self.path == "/streamed-big":  # no Content-Length: the cap must hold while streaming
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(png("red") + b"\0" * (CAP * 4))
            self.close_connection = True
        elif self.path == "/slow":
            time.sleep(3)
            self.reply(200, png("red"), "image/png")
        else:
            self.reply(404, b"", "text/plain")

    def reply(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def port():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Site)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def tls_site(tmp_path_factory):
    """The same site over https, its certificate naming images.test only; and a client context trusting its CA."""
    server_tls, client_tls = tls_pair(tmp_path_factory.mktemp("tls"), "images.test")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Site)
    server.socket = server_tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], client_tls
    server.shutdown()


async def to_test_server(host: str, port: int) -> list[str]:
    """The tests' DNS: every made-up name resolves to the test server (on loopback)."""
    return ["127.0.0.1"]


def fetcher(domains=("images.test", "elsewhere.test"), resolve=to_test_server, allow_loopback=True, tls=None,
            **spec) -> ImageFetcher:
    spec = ImageUrlsSpec(enabled=True, allowed_domains=domains, **{"max_bytes": CAP, "timeout_s": 5.0} | spec)
    return ImageFetcher(spec, resolve=resolve, allow_loopback_for_tests=allow_loopback, tls=tls)


def fetch(images: ImageFetcher, url: str) -> str:
    return asyncio.run(images.data_url(url, PARAM))


def refusal(images: ImageFetcher, url: str) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        fetch(images, url)
    assert caught.value.param == PARAM and str(caught.value).startswith(PARAM)
    return str(caught.value)


def pixels(url: str) -> tuple:
    data = base64.b64decode(url.split(",", 1)[1])
    return Image.open(io.BytesIO(data)).convert("RGB").getpixel((0, 0))


def test_an_allowed_host_is_fetched_from_the_address_dns_gave_with_its_own_host_header(port):
    Site.hits.clear()
    url = fetch(fetcher(), f"http://images.test:{port}/red.png")
    assert url == "data:image/png;base64," + base64.b64encode(png("red")).decode()
    assert Site.hits == [("/red.png", f"images.test:{port}")]
    assert fetch(fetcher(), f"http://cdn.images.test:{port}/red.png").startswith("data:image/png")  # a subdomain


def test_https_is_verified_against_the_urls_host_while_connected_to_the_pinned_address(tls_site):
    port, client_tls = tls_site
    Site.hits.clear()
    assert fetch(fetcher(tls=client_tls), f"https://images.test:{port}/red.png").startswith("data:image/png")
    assert Site.hits == [("/red.png", f"images.test:{port}")]
    # the certificate does not name cdn.images.test: allowed and resolved, still refused by TLS
    assert "could not be fetched" in refusal(fetcher(tls=client_tls), f"https://cdn.images.test:{port}/red.png")


def test_a_loopback_address_is_refused_before_any_request(port):
    """SSRF: the real resolver, a host the operator allowed, an address that is not public."""
    Site.hits.clear()
    strict = fetcher(domains=("localhost", "127.0.0.1"), resolve=system_resolve, allow_loopback=False)
    for host in ("localhost", "127.0.0.1"):
        assert "non-public address: refused" in refusal(strict, f"http://{host}:{port}/red.png")
    assert Site.hits == []


@pytest.mark.parametrize("address", ["10.0.0.5", "172.16.3.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
                                     "0.0.0.0", "224.0.0.1", "240.0.0.1", "::1", "fe80::1", "fc00::1",
                                     "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::a00:1", "2002:a00:1::1"])
def test_non_public_addresses_are_refused_however_spelled(address):
    assert not public_address(address)


def test_the_tests_flag_lets_loopback_alone_through():
    assert public_address("127.0.0.1", allow_loopback=True) and public_address("::1", allow_loopback=True)
    assert not public_address("10.0.0.5", allow_loopback=True) and not public_address("169.254.169.254", True)


def test_public_addresses_pass():
    assert public_address("93.184.215.14") and public_address("2606:2800:21f:cb07:6820:80da:af6b:8b2c")


def test_one_private_address_among_the_answers_refuses_the_host(port):
    async def mixed(host: str, port: int) -> list[str]:
        return ["93.184.215.14", "10.0.0.5"]
    assert "non-public" in refusal(fetcher(resolve=mixed, allow_loopback=False), f"http://images.test:{port}/red.png")


def test_hosts_outside_the_allowlist_and_credentials_are_refused(port):
    Site.hits.clear()
    assert "allowed_domains" in refusal(fetcher(), f"http://evil.test:{port}/red.png")
    assert "allowed_domains" in refusal(fetcher(), f"http://notimages.test:{port}/red.png")  # not a subdomain
    assert "no credentials" in refusal(fetcher(), f"http://user:pw@images.test:{port}/red.png")
    assert "does not parse" in refusal(fetcher(), "http://images.test:abc/red.png")  # a 400, never a 500
    assert "not a TCP port" in refusal(fetcher(), "http://images.test:99999/red.png")
    assert Site.hits == []


def test_redirects_stay_on_the_host(port):
    Site.hits.clear()
    assert fetch(fetcher(), f"http://images.test:{port}/same-host").startswith("data:image/png")
    message = refusal(fetcher(), f"http://images.test:{port}/other-host")
    assert "redirects to another host (elsewhere.test)" in message  # though elsewhere.test is allowed too
    assert "redirects more than 3 times" in refusal(fetcher(), f"http://images.test:{port}/loop")
    assert [p for p, _ in Site.hits[:3]] == ["/same-host", "/red.png", "/other-host"]
    assert ("/red.png", f"elsewhere.test:{port}") not in Site.hits


def test_the_size_cap_holds_by_header_and_while_streaming(port):
    assert f"at most {CAP} are fetched" in refusal(fetcher(), f"http://images.test:{port}/declared-big")
    assert f"over {CAP} bytes" in refusal(fetcher(), f"http://images.test:{port}/streamed-big")
    assert fetch(fetcher(max_bytes=CAP * 8), f"http://images.test:{port}/streamed-big")  # within a larger cap


def test_the_time_cap_ends_a_slow_fetch(port):
    started = time.monotonic()
    assert "not fetched within 0.3 s" in refusal(fetcher(timeout_s=0.3), f"http://images.test:{port}/slow")
    assert time.monotonic() - started < 2.5  # the server answers after 3 s


def test_a_gif_is_its_first_frame_and_other_files_are_refused(port):
    url = fetch(fetcher(), f"http://images.test:{port}/anim.gif")
    assert url.startswith("data:image/png;base64,") and pixels(url) == (255, 0, 0)  # red, not the blue 2nd frame
    assert "not a PNG, JPEG, WebP or GIF" in refusal(fetcher(), f"http://images.test:{port}/text")
    assert "HTTP 404" in refusal(fetcher(), f"http://images.test:{port}/missing.png")


def test_off_nothing_is_fetched(port):
    Site.hits.clear()
    request = AnswerRequest(query="what is this?", top_k=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"http://images.test:{port}/red.png"}}]}])
    off = ImageFetcher(ImageUrlsSpec(), resolve=to_test_server, allow_loopback_for_tests=True)
    with pytest.raises(InvalidRequestError, match="ingress.image_urls.enabled is off") as caught:
        asyncio.run(off.fetch_into(request))
    assert caught.value.param == PARAM and Site.hits == []
    asyncio.run(fetcher().fetch_into(request))  # on: the URL's image takes its place
    assert request.messages[0].content[0].image_url.url.startswith("data:image/png;base64,")


def test_off_by_default_a_url_is_a_400_naming_the_part_and_the_config_key(app):  # noqa: F811
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    response = call(app, "POST", "/v1/chat/completions", json={"model": "qvpic", "messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url" and "ingress.image_urls.enabled" in error["message"]


def test_a_fetched_image_is_priced_as_the_same_image_sent_inline(roles, serving_store, port):  # noqa: F811
    args = AppConfig(store={"uri": serving_store.uri}, model=serving_store.model, router={"max_chunks": MAX_CHUNKS},
                     ingress={"default_top_k": 2})
    fetching = make_api(InProcessBackend(roles.router, roles.loader, roles.generator), api_spec(args),
                        images=fetcher(max_bytes=8 << 20))

    def usage(url: str) -> int:
        messages = [{"role": "user", "content": [{"type": "text", "text": "What colour is it?"},
                                                 {"type": "image_url", "image_url": {"url": url}}]}]
        response = call(fetching, "POST", "/v1/chat/completions", headers=NO_CACHE,
                        json={"model": "qvpic-chat", "messages": messages, "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    by_url, inline = usage(f"http://images.test:{port}/red.png"), usage(data_url("red"))
    text_only = call(fetching, "POST", "/v1/chat/completions", headers=NO_CACHE, json={
        "model": "qvpic-chat", "messages": [{"role": "user", "content": "What colour is it?"}], "max_tokens": 2,
    }).json()["usage"]["prompt_tokens"]
    assert by_url == inline > text_only


def test_the_config_is_off_by_default_and_on_needs_domains():
    assert AppConfig.model_fields["ingress"].default.image_urls.enabled is False
    with pytest.raises(ValueError, match="needs allowed_domains"):
        ImageUrlsSpec(enabled=True)
    with pytest.raises(ValueError, match="lowercase host name"):
        ImageUrlsSpec(allowed_domains=("https://images.example.com",))
    with pytest.raises(ValueError, match="less than or equal"):
        ImageUrlsSpec(max_bytes=9 << 20)  # past the inline image's cap
