"""A picture of serve.py's page at work: three requests sent from the page, taken while all three decode.

    python bench/page_screenshot.py --checkpoint runs/RUN --out docs/serving_page.png

It starts serve.py on a free loopback port, opens the page in Debian's chromium (headless, through Playwright),
sends one prompt three times, and takes the picture once each of them has drawn a third of its tokens.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import REPO, run_tool  # noqa: E402
from runtime.checkpoint import existing_checkpoint  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError  # noqa: E402

# No window, no sandbox (it may run as root), and none of the browser's own calls to the network.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGE_PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, required=True, help="a run directory or .pt file")
    parser.add_argument("--out", type=Path, required=True, help="the PNG file to write")
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise UsageError("the picture needs Playwright: pip install playwright") from None
    if shutil.which("chromium") is None:
        raise UsageError("the picture needs a browser: apt-get install chromium")
    server = subprocess.Popen([sys.executable, str(REPO / "serve.py"), "--checkpoint", str(args.checkpoint),
                               "--port", "0", "--threads", "1"], stdout=subprocess.PIPE, text=True)
    try:
        url = "http://" + server.stdout.readline().split("http://")[1].split()[0]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(url)
            page.fill("#prompt", PAGE_PROMPT)
            page.fill("#maxtokens", str(args.max_tokens))
            page.fill("#copies", "3")
            page.click("#send")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and page.evaluate(
                    f"[...document.querySelectorAll('.card pre span:last-child')]"
                    f".filter(s => s.textContent.length > {args.max_tokens // 3}).length") < 3:
                time.sleep(0.02)
            page.screenshot(path=str(args.out))
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_tool(main)
