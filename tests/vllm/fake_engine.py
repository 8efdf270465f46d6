"""A stand-in for forge_vllm_engine.py that speaks its wire protocol without vLLM (the stub's own tests).

Run as ``python fake_engine.py ENGINE_SCRIPT --version-dir DIR --fd N`` (``FORGE_VLLM_PYTHON`` points at a wrapper
that calls it). It answers the upper-cased prompt (streamed: one character a response; each image's size in bytes
after it), refuses the sampling key ``bogus``, exits with status 3 on the prompt ``die``, streams the prompt
``slow`` for a minute, and appends each ``abort`` it gets to ``DIR/aborts.txt``. With ``--metrics``, each answered
request is one engine step's statistics: its prompt's characters as prompt tokens, its answer's as generation
tokens, a first token after 0.03 s, 2 s end to end, nothing running or waiting after it.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(sys.argv[1]))  # forge_vllm_wire beside the real engine

import forge_vllm_wire as wire  # noqa: E402


def main() -> None:
    args = sys.argv[2:]
    version_dir, fd = args[args.index("--version-dir") + 1], int(args[args.index("--fd") + 1])
    sock = socket.socket(fileno=fd)
    lock = threading.Lock()
    aborted: set[str] = set()

    def send(message: dict) -> None:
        with lock:
            sock.sendall(wire.pack(message))

    doc = json.load(open(os.path.join(version_dir, "model.json")))
    if "fail" in doc["model"]:
        send({"op": "fatal", "error": "ValueError: no such model"})
        return
    send({"op": "ready", "vllm": "fake", "max_model_len": 64})
    metrics = "--metrics" in args

    def generate(message: dict) -> None:
        params = json.loads(message["parameters"] or "{}")
        if "bogus" in params:
            send({"id": message["id"], "error": "ValueError: unknown sampling parameter bogus"})
            return
        prompt = message["prompt"]
        if prompt == "die":
            os._exit(3)
        text = prompt.upper() if prompt != "slow" else "x" * 300
        if message.get("images"):  # what the engine got: the images' decoded sizes (vLLM's multi_modal_data)
            text += "".join(f"[{len(base64.b64decode(image))} bytes]" for image in message["images"])
        pieces = list(text) if message["stream"] else [text]
        for n, piece in enumerate(pieces):
            if message["id"] in aborted:
                return
            last = n == len(pieces) - 1
            outputs = {"text_output": [(prompt if message["prepend"] and n == 0 else "") + piece]}
            if "num_input_tokens" in message["returns"]:
                outputs["num_input_tokens"] = [len(prompt)]
            send({"id": message["id"], "final": last, "outputs": outputs})
            if last and metrics:
                send({"op": "stats", "running": 0, "waiting": 0, "kv_cache_usage": 0.0, "prompt_tokens": len(prompt),
                      "generation_tokens": len(text), "ttft": [0.03], "tpot": [], "e2e": [2.0],
                      "request_prompt_tokens": [len(prompt)], "request_generation_tokens": [len(text)], "n": [1]})
            if prompt == "slow":
                time.sleep(0.2)

    inbox = wire.Reader(sock)
    while True:
        message = inbox.receive()
        if message is None:
            return
        if message["op"] == "abort":
            aborted.add(message["id"])
            with open(os.path.join(version_dir, "aborts.txt"), "a") as file:
                file.write(message["id"] + "\n")
        else:
            threading.Thread(target=generate, args=(message,), daemon=True).start()


if __name__ == "__main__":
    main()
