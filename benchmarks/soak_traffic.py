"""The soak's clients: request kinds against one ``forge serve`` each, and the tally of their outcomes.

A request ends one of five ways: succeeded, failed with a clear error (an HTTP error with its message, a refused
or closed connection, an error event in a stream), hung (no end within ``HUNG_S``), lost (it ended with neither
its answer nor an error: a stream without its last event, an answer without its outputs) or abandoned (the
client gave up on purpose).
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.request

HUNG_S = 60.0
ADAPTERS = ("A", "B")
DECODER_KINDS = ("triton_stream", "chat", "chat_stream", "cancelled", "abandoned")
IMAGE_KINDS = ("image_chat", "image_stream")
TP2_KINDS = ("tp2_generate", "tp2_chat")
SEARCHES = ("Where is the Eiffel Tower?", "How do plants make food from sunlight?", "What do I need to bake cookies?")


class Tally:
    """Outcomes of the requests sent in one phase."""

    def __init__(self, name: str):
        self.name = name
        self.counts = {k: 0 for k in ("sent", "succeeded", "failed_clear", "hung", "lost", "abandoned")}
        self.kinds: dict[str, dict[str, int]] = {}  # request kind → outcome → count
        self.errors: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, outcome: str, error: str | None = None, kind: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if kind is not None:
                by_kind = self.kinds.setdefault(kind, {})
                by_kind[outcome] = by_kind.get(outcome, 0) + 1
            if error:
                key = error[:120]
                self.errors[key] = self.errors.get(key, 0) + 1


def post(url: str, body: dict, timeout: float = HUNG_S):
    """A JSON POST; an HTTP error becomes ValueError with its message, a timeout TimeoutError."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        message = exc.read().decode(errors="replace")[:200]
        raise ValueError(f"HTTP {exc.code}: {message}") from None
    except socket.timeout as exc:
        raise TimeoutError(str(exc)) from None


def events(response, limit: int | None = None) -> list[str]:
    """The ``data:`` events of a server-sent-events response (the first ``limit``)."""
    found = []
    try:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:"):
                found.append(line[5:].strip())
                if limit and len(found) >= limit:
                    break
    except socket.timeout as exc:
        raise TimeoutError(str(exc)) from None
    return found


def _chat_outcome(kind: str, answer: dict):
    return ("succeeded", None) if answer.get("choices") else ("lost", f"{kind}: {str(answer)[:120]}")


def _stream_outcome(kind: str, found: list[str]):
    errors = [e for e in found if e.startswith('{"error"')]
    if errors:
        return "failed_clear", f"{kind}: {errors[0][:120]}"
    return ("succeeded", None) if found and found[-1] == "[DONE]" else ("lost", f"{kind}: {found[-2:]}")


class Requests:
    """The request kinds against one ``forge serve`` (``info``: its endpoints, ``model``: its OpenAI model id).

    Each kind is a method ``_KIND`` returning (outcome, error); ``image`` (PNG bytes) is what image kinds send.
    """

    def __init__(self, info: dict, model: str, image: bytes | None = None):
        self.http, self.model = info["http"], model
        self.base = info["openai"].removesuffix("/v1") if info.get("openai") else None
        self.image_url = "data:image/png;base64," + base64.b64encode(image).decode() if image else None
        self._layout: str | None = None

    def _chat_body(self, stream: bool, max_tokens: int = 60) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": "hello world"}],
                "max_tokens": max_tokens, "stream": stream}

    def _generator(self) -> tuple[str, dict]:
        """The model Triton's generate endpoint streams from, with its request body: the LLM-API layout's
        ``tensorrt_llm`` (the default) or an engine layout's ``ensemble``."""
        if self._layout is None:
            try:
                with urllib.request.urlopen(f"{self.http}/v2/models/ensemble/config", timeout=10):
                    self._layout = "ensemble"
            except urllib.error.HTTPError:  # no such model
                self._layout = "tensorrt_llm"
        if self._layout == "ensemble":
            return "ensemble", {"text_input": "hello world", "max_tokens": 60, "stream": True}
        return "tensorrt_llm", {"text_input": "hello world", "sampling_param_max_tokens": 60, "streaming": True}

    def _triton_stream(self):
        model, body = self._generator()
        with post(f"{self.http}/v2/models/{model}/generate_stream", body) as response:
            found = events(response)
        errors = [e for e in found if '"error"' in e]
        if errors:
            return "failed_clear", f"triton_stream: {errors[0][:120]}"
        return ("succeeded", None) if found else ("lost", "triton_stream: no event")

    def _chat(self, kind: str = "chat", **changes):
        with post(f"{self.base}/v1/chat/completions", {**self._chat_body(False), **changes}) as response:
            return _chat_outcome(kind, json.loads(response.read()))

    def _chat_stream(self):
        with post(f"{self.base}/v1/chat/completions", self._chat_body(True)) as response:
            return _stream_outcome("chat_stream", events(response))

    def _chat_lora(self):
        return self._chat("chat_lora", model=ADAPTERS[int(time.monotonic() * 10) % len(ADAPTERS)])

    def _cancelled(self):
        with post(f"{self.base}/v1/chat/completions", self._chat_body(True)) as response:
            found = events(response, limit=2)  # then the connection closes: the server cancels
        return ("succeeded", None) if len(found) == 2 else ("lost", f"cancelled: {found}")

    def _abandoned(self):
        try:
            with post(f"{self.base}/v1/chat/completions", self._chat_body(False), timeout=0.2) as response:
                response.read()
        except (TimeoutError, urllib.error.URLError, socket.timeout):
            pass
        return "abandoned", None

    def _image_body(self, stream: bool) -> dict:
        content = [{"type": "image_url", "image_url": {"url": self.image_url}},
                   {"type": "text", "text": "What is this?"}]
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 16,
                "stream": stream}

    def _image_chat(self):
        with post(f"{self.base}/v1/chat/completions", self._image_body(False)) as response:
            return _chat_outcome("image_chat", json.loads(response.read()))

    def _image_stream(self):
        with post(f"{self.base}/v1/chat/completions", self._image_body(True)) as response:
            return _stream_outcome("image_stream", events(response))

    def _tp2_generate(self):
        body = {"text_input": "hello world", "max_tokens": 20, "bad_words": "", "stop_words": ""}
        with post(f"{self.http}/v2/models/ensemble/generate", body) as response:
            answer = json.loads(response.read())
        return ("succeeded", None) if "text_output" in answer else ("lost", f"tp2_generate: {str(answer)[:120]}")

    def _tp2_chat(self):
        return self._chat("tp2_chat", max_tokens=20)

    def _search(self):
        query = SEARCHES[int(time.monotonic() * 10) % len(SEARCHES)]
        inputs = [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [query]},
                  {"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": [3]}]
        with post(f"{self.http}/v2/models/search_text/infer", {"inputs": inputs}) as response:
            answer = json.loads(response.read())
        outputs = {o["name"]: o["data"] for o in answer.get("outputs", [])}
        return ("succeeded", None) if outputs.get("ids") else ("lost", f"search: {str(answer)[:120]}")


class Clients:
    """``n`` client threads cycling through ``kinds`` of ``requests``; each outcome goes to ``traffic.tally``."""

    def __init__(self, traffic: "Traffic", requests: Requests, kinds: tuple[str, ...], n: int):
        self.traffic, self.requests, self.kinds = traffic, requests, kinds
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        turn = index
        while not self.halt.is_set() and not self.traffic.halt.is_set():
            kind = self.kinds[turn % len(self.kinds)]
            turn += 1
            tally = self.traffic.tally
            tally.add("sent", kind=kind)
            try:
                outcome, error = getattr(self.requests, f"_{kind}")()
            except TimeoutError as exc:
                outcome, error = "hung", f"{kind}: {exc}"
            except (urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
                outcome, error = "failed_clear", f"{kind}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            tally.add(outcome, error, kind)
            if outcome != "succeeded":
                time.sleep(0.2)

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(HUNG_S + 5)


class Traffic:
    """Every group of clients of the soak; ``tally`` is the current phase's."""

    def __init__(self):
        self.tally = Tally("start")
        self.halt = threading.Event()
        self.groups: list[Clients] = []

    def add(self, requests: Requests, kinds: tuple[str, ...], n: int) -> Clients:
        group = Clients(self, requests, kinds, n)
        self.groups.append(group)
        return group

    def stop(self) -> None:
        self.halt.set()
        for group in self.groups:
            group.stop()


def ready(base: str) -> bool:
    """Whether forge serve's ``/health/ready`` (``base``: its OpenAI API root) answers 200."""
    try:
        with urllib.request.urlopen(f"{base}/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def answered(url: str, body: dict) -> bool:
    """Whether a JSON POST to ``url`` got 200 within 30 s."""
    try:
        with post(url, body, timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def search_once(http: str) -> bool:
    inputs = [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]},
              {"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": [1]}]
    return answered(f"{http}/v2/models/search_text/infer", {"inputs": inputs})


def chat_once(base: str, model: str, image_url: str | None = None) -> bool:
    content = "hi" if image_url is None else [{"type": "image_url", "image_url": {"url": image_url}},
                                              {"type": "text", "text": "hi"}]
    return answered(f"{base}/v1/chat/completions",
                    {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4})
