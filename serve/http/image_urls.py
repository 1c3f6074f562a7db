"""Chat images by http(s) URL, fetched by the ingress where the operator allows it (`ingress.image_urls`).

Off by default: the server fetches nothing, and an image part with an http(s) URL is a 400 naming it
(`messages[i].content[j].image_url`) and the config key. On, `ImageFetcher.fetch_into` fetches every such URL of
a request once its rate is charged, before it is routed, and puts the image in its place as a data: URL: the
router then prices and charges its vision tokens exactly as a data: URL's (the token budget counts it), and
the prefix cache keys on the image's bytes, never on a URL whose content may change. Each fetch:

- goes only to a host of `allowed_domains` (a domain or one of its subdomains), with no credentials in the URL;
- resolves the host once and refuses it unless every address is public (not private, loopback, link-local,
  multicast, reserved, unspecified or shared; IPv4 inside IPv6 unwrapped), then connects to that address with the
  URL's host as the Host header and as TLS's SNI and certificate name: a second lookup, which DNS rebinding
  would answer with an internal address, never happens;
- ignores proxies from the environment (a proxy would resolve and connect on its own);
- follows at most `max_redirects` redirects by hand, each to the same host (another host: refused);
- reads at most `max_bytes` (Content-Length checked first, then counted as the body streams; no compressed
  encoding is asked for or decoded), all within `timeout_s` (DNS, redirects and body together);
- keeps PNG, JPEG and WebP as they are (the router decodes and checks them as it does data: URLs); a GIF becomes
  its first frame, as PNG; anything else is refused.

All of it runs on the event loop's own I/O (httpx's async client; DNS on the loop's resolver thread) and the
GIF's decoding on a worker thread: the loop is never blocked. docs/SECURITY.md ("Image URLs") lists the limits.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from PIL import Image, UnidentifiedImageError

from schemas.api import AnswerRequest
from schemas.config import ImageUrlsSpec
from schemas.conversation import IMAGE_URLS_KEY, MAX_IMAGE_PIXELS, ImagePart, ImageURL
from schemas.errors import InvalidRequestError

Resolve = Callable[[str, int], Awaitable[list[str]]]  # (host, port) → its addresses
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv6 that a NAT64 gateway turns into the IPv4 in its last 32 bits


class FetchRefused(Exception):
    """Why an image URL was not fetched (the client's 400 says it)."""


async def system_resolve(host: str, port: int) -> list[str]:
    """The host's addresses, by the loop's resolver (getaddrinfo on a worker thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def public_address(address: str, allow_loopback: bool = False) -> bool:
    """Whether `address` is on the public internet: anything else (private, loopback, link-local such as the
    cloud metadata endpoint 169.254.169.254, multicast, reserved, unspecified, shared 100.64/10) is refused.
    `allow_loopback`: for tests only, whose server can only be on loopback."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):  # an IPv4 address carried in IPv6 is judged as that IPv4 address
        if ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        else:
            ip = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None) or ip
    if allow_loopback and ip.is_loopback:
        return True
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified)


def refused(param: str, message: str) -> InvalidRequestError:
    error = InvalidRequestError(f"{param}: {message}")
    error.param = param
    return error


@dataclass
class ImageFetcher:
    spec: ImageUrlsSpec
    resolve: Resolve = system_resolve  # a test seam: tests map a made-up allowed domain to their server
    allow_loopback_for_tests: bool = False  # only tests set it: production refuses loopback like any private address
    tls: ssl.SSLContext | None = None  # whom https fetches trust (None: httpx's default, certifi; tests: their CA)

    async def fetch_into(self, request: AnswerRequest) -> None:
        """Each http(s) image of `request.messages` replaced by its fetched image's data: URL, all fetched together
        (InvalidRequestError, a 400 naming the part, for the first that is refused)."""
        parts: list[tuple[str, ImageURL]] = [
            (f"messages[{i}].content[{j}].image_url", part.image_url)
            for i, message in enumerate(request.messages or ()) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if isinstance(part, ImagePart) and part.image_url.remote]
        if not parts:
            return
        if not self.spec.enabled:
            param = parts[0][0]
            raise refused(param, f"image URLs are not fetched by this server (serve config {IMAGE_URLS_KEY} is "
                                 "off); send the image as a data: URL")
        fetched = await asyncio.gather(*(self.data_url(image.url, param) for param, image in parts))
        for (_, image), url in zip(parts, fetched):
            image.url = url  # the router reads the image as it reads a data: URL's

    async def data_url(self, url: str, param: str) -> str:
        """The image at `url` as a data: URL (PNG, JPEG, WebP; a GIF's first frame as PNG)."""
        try:
            body = await asyncio.wait_for(self.fetch(url), self.spec.timeout_s)
            return await asyncio.to_thread(as_data_url, body)
        except TimeoutError:
            raise refused(param, f"the image was not fetched within {self.spec.timeout_s:g} s "
                                 "(ingress.image_urls.timeout_s)") from None
        except FetchRefused as error:
            raise refused(param, str(error)) from None
        except httpx.InvalidURL as error:  # the URL itself, or a redirect's Location
            raise refused(param, f"the image URL does not parse: {str(error)[:200]}") from None
        except (httpx.HTTPError, OSError) as error:  # connection refused or reset, a TLS failure, no such host
            raise refused(param, f"the image could not be fetched ({type(error).__name__})") from None

    async def fetch(self, url: str) -> bytes:
        """The body at `url`: checked, pinned to the address DNS gave once, redirects followed on its host only."""
        current = httpx.URL(url)
        host = self.allowed_host(current)
        port = current.port or (443 if current.scheme == "https" else 80)
        addresses = await self.resolve(host, port)
        if not addresses or not all(public_address(a, self.allow_loopback_for_tests) for a in addresses):
            raise FetchRefused(f"the image URL's host {host} resolves to a private, loopback or otherwise "
                               "non-public address: refused")
        address = addresses[0]
        async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=self.spec.timeout_s,
                                     verify=self.tls if self.tls is not None else True) as client:
            for _ in range(self.spec.max_redirects + 1):
                headers = {"Host": current.netloc.decode("ascii"), "Accept": "image/*", "Accept-Encoding": "identity"}
                async with client.stream("GET", current.copy_with(host=address), headers=headers,
                                         extensions={"sni_hostname": host}) as response:
                    if response.is_redirect:
                        current = current.join(response.headers["location"])
                        if current.scheme not in ("http", "https") or current.userinfo or \
                                _host(current) != host:
                            raise FetchRefused(f"the image URL redirects to another host ({_host(current)}): "
                                               "refused")
                        continue
                    if response.status_code != 200:
                        raise FetchRefused(f"the image URL answered HTTP {response.status_code}")
                    return await self.read(response)
        raise FetchRefused(f"the image URL redirects more than {self.spec.max_redirects} times "
                           "(ingress.image_urls.max_redirects)")

    def allowed_host(self, url: httpx.URL) -> str:
        if url.scheme not in ("http", "https"):
            raise FetchRefused("an image URL is http or https")
        if url.userinfo:
            raise FetchRefused("an image URL carries no credentials")
        if url.port is not None and not 0 < url.port < 65536:
            raise FetchRefused(f"the image URL's port {url.port} is not a TCP port")
        host = _host(url)
        if not any(host == d or host.endswith("." + d) for d in self.spec.allowed_domains):
            raise FetchRefused(f"the image URL's host {host} is not one this server fetches from "
                               "(ingress.image_urls.allowed_domains)")
        return host

    async def read(self, response: httpx.Response) -> bytes:
        """The body, refused past `max_bytes`: by its Content-Length before reading, else as it streams."""
        cap = self.spec.max_bytes
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise FetchRefused(f"the image is {length} bytes; at most {cap} are fetched (ingress.image_urls.max_bytes)")
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > cap:
                raise FetchRefused(f"the image is over {cap} bytes; at most {cap} are fetched "
                                   "(ingress.image_urls.max_bytes)")
        return bytes(body)


def _host(url: httpx.URL) -> str:
    """The URL's host as DNS takes it: IDNA-encoded, lowercase, without a trailing dot."""
    return url.raw_host.decode("ascii").lower().rstrip(".")


def as_data_url(body: bytes) -> str:
    """`body` as a data: URL: PNG, JPEG and WebP as they are (the router decodes and checks them), a GIF's first
    frame as PNG (the model takes one still image); anything else is refused."""
    if body.startswith(b"\x89PNG\r\n\x1a\n"):
        kind = "png"
    elif body.startswith(b"\xff\xd8\xff"):
        kind = "jpeg"
    elif body[:4] == b"RIFF" and body[8:12] == b"WEBP":
        kind = "webp"
    elif body[:6] in (b"GIF87a", b"GIF89a"):
        kind, body = "png", first_frame(body)
    else:
        raise FetchRefused("the fetched file is not a PNG, JPEG, WebP or GIF image")
    return f"data:image/{kind};base64,{base64.b64encode(body).decode('ascii')}"


def first_frame(gif: bytes) -> bytes:
    """A GIF's first frame, as PNG: its size checked against MAX_IMAGE_PIXELS before any pixel is decoded."""
    try:
        with Image.open(io.BytesIO(gif), formats=("GIF",)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise FetchRefused(f"the GIF has {width}x{height} = {width * height} pixels; at most "
                                   f"{MAX_IMAGE_PIXELS} are accepted")
            image.seek(0)
            frame = image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as error:
        raise FetchRefused(f"the GIF does not decode: {error}") from None
    buffer = io.BytesIO()
    frame.save(buffer, "PNG")
    return buffer.getvalue()
