"""A local OpenAI-compatible server for trying the openai engine without a GPU cluster.

    python -m extract.regenerate.local_server --port 8011  # packaged SmolLM2 on 127.0.0.1:8011
    python -m extract.regenerate --engine openai --base-url http://127.0.0.1:8011/v1 \\
        --model "$(python -m extract.regenerate.local_server --print-model)" --out x.jsonl --limit 8

It runs transformers' own server (`transformers serve`, the `serving` extra of transformers) on a
plain HF directory written from the target (target.loader.save_hf_dir). The tests and
bench/openai_bench.py start it the same way; it is stopped by its pid, never by name.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import click

__all__ = ["LocalServer", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, end the server when the process that started it ends
    (a bench or test killed by a signal must not leave a server behind)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalServer:
    """`transformers serve MODEL_DIR` on 127.0.0.1:port, started and stopped by this object."""

    def __init__(self, model_dir: str, port: int = 0, *, log: str | None = None,
                 continuous_batching: bool = False):
        self.model_dir, self.port = str(model_dir), port or free_port()
        self.log, self.cb, self.proc = log, continuous_batching, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 180.0) -> LocalServer:
        exe = shutil.which("transformers",
                           path=str(Path(sys.executable).parent)) or shutil.which("transformers")
        if exe is None:
            raise ValueError("`transformers serve` is not installed: pip install "
                             "'transformers[serving]'")
        cmd = [exe, "serve", self.model_dir, "--device", "cpu", "--host", "127.0.0.1", "--port",
               str(self.port)]
        if self.cb:
            cmd.append("--continuous-batching")
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"},
                                     preexec_fn=_die_with_parent)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise ValueError(f"transformers serve exited with {self.proc.returncode} (log: "
                                 f"{self.log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise ValueError(f"transformers serve did not answer on port {self.port} within "
                         f"{timeout:.0f} s")

    def stop(self) -> None:
        """End the server process this object started (kill -9)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@click.command()
@click.option("--target", default="",
              help="HF directory or .gguf; default: the packaged SmolLM2 GGUF.")
@click.option("--dir", "model_dir", default="stores/served_target", show_default=True,
              help="Where the plain HF copy of the target is written (reused if present).")
@click.option("--port", default=8011, show_default=True)
@click.option("--continuous-batching", is_flag=True,
              help="transformers serve --continuous-batching.")
@click.option("--print-model", is_flag=True,
              help="Print the model name the server answers to, and exit.")
def main(target: str, model_dir: str, port: int, continuous_batching: bool,
         print_model: bool) -> None:
    """Serve the target on 127.0.0.1 until Ctrl-C."""
    if print_model:
        click.echo(model_dir)
        return
    from target.loader import save_hf_dir  # here: torch and transformers, only to write the dir

    if not (Path(model_dir) / "config.json").exists():
        save_hf_dir(target, model_dir)
    with LocalServer(model_dir, port, continuous_batching=continuous_batching) as s:
        click.echo(f"serving {model_dir} at {s.url} (Ctrl-C to stop)")
        try:
            s.proc.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
