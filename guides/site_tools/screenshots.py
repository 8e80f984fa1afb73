"""Screenshots of the built site, taken with headless Chromium.

Serves the built site (`guides/_site`, from `mkdocs build`) on 127.0.0.1
with Python's http.server and takes one screenshot per page named below
(the start page and a guide page), 1280x1600, into `guides/_screenshots/`.
Prints each file's name and size, and exits non-zero when one is missing
or tiny (under 20 kB: a blank or unstyled page compresses to less).

    python -m mkdocs build --strict -f guides/mkdocs.yml
    python guides/site_tools/screenshots.py
"""

import argparse
import functools
import http.server
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

GUIDES = pathlib.Path(__file__).resolve().parents[1]
SITE = GUIDES / "_site"
OUTPUT = GUIDES / "_screenshots"
PAGES = {
    "start_page.png": "index.html",
    "guide_mixed_precision_with_fit.png": "guides/mixed_precision_with_fit.html",
}
MIN_BYTES = 20_000
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,1600",
]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit(
        "Expected Chromium on PATH (chromium, chromium-browser or "
        "google-chrome); found none. Install it, e.g. `apt-get install "
        "chromium` on Debian."
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=pathlib.Path, default=SITE)
    parser.add_argument("--output", type=pathlib.Path, default=OUTPUT)
    args = parser.parse_args()
    if not (args.site / "index.html").exists():
        raise SystemExit(
            f"No built site in {args.site}: run `python -m mkdocs build "
            "--strict -f guides/mkdocs.yml` first."
        )
    browser = _browser()
    shutil.rmtree(args.output, ignore_errors=True)
    args.output.mkdir(parents=True)
    handler = functools.partial(_QuietHandler, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    failures = []
    try:
        for name, page in PAGES.items():
            target = args.output / name
            with tempfile.TemporaryDirectory() as profile:
                result = subprocess.run(
                    [
                        browser,
                        *FLAGS,
                        f"--user-data-dir={profile}",
                        f"--screenshot={target}",
                        f"http://127.0.0.1:{port}/{page}",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            size = target.stat().st_size if target.exists() else 0
            print(
                f"{target.relative_to(GUIDES.parent)}  {size} bytes  ({page})"
            )
            if result.returncode != 0 or size < MIN_BYTES:
                failures.append(
                    f"{name}: exit {result.returncode}, {size} bytes "
                    f"(expected at least {MIN_BYTES})\n{result.stderr[-2000:]}"
                )
    finally:
        server.shutdown()
    if failures:
        print("\n".join(failures), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
