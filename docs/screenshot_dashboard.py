"""Takes docs/dashboard.png (shown in the README): `pagedlm serve` on the embedded SmolLM2
with a small KV cache, a burst of requests that share a prefix (some with n = 3, enough
to preempt), and headless Chromium (Debian's chromium + chromedriver, via Selenium) on
/dashboard in the middle of it.

usage: python docs/screenshot_dashboard.py [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--delay", type=float, default=4.0, help="seconds into the burst")
    args = p.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.mkdtemp()) / "server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedlm.entrypoints.cli", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--kv-cache-memory", "64M", "--max-num-seqs", "32",
         "--uvicorn-log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    options = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1500"):
        options.add_argument(a)
    options.binary_location = shutil.which("chromium")
    driver = None
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.5)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        driver.get(url + "/dashboard")
        time.sleep(2)

        def complete(body: dict) -> None:
            request = urllib.request.Request(
                url + "/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=300).read()

        prefix = ("You are a careful historian. Write a detailed chronicle of the city, "
                  "its rivers, bridges, markets and people, century by century. ") * 2
        threads = []
        for i in range(14):
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prefix + f"Chapter {i}:",
                    "max_tokens": 160, "temperature": 0.8, "seed": i, "ignore_eos": True,
                    "n": 3 if i % 4 == 0 else 1}
            threads.append(threading.Thread(target=complete, args=(body,), daemon=True))
        for t in threads:
            t.start()
            time.sleep(0.15)
        time.sleep(args.delay)
        driver.save_screenshot(args.out)
        print(f"wrote {args.out}")
        for t in threads:
            t.join(300)
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
