"""A picture of serve.py's page at work: three requests sent from the page, taken while all three decode.

    python bench/page_screenshot.py --checkpoint runs/RUN --out docs/serving_page.png

It starts serve.py on a free loopback port, opens the page in Debian's chromium (headless, through Playwright),
sends one prompt three times, and takes the picture as soon as the page shows all three decoding: the whole page,
its timeline included.
"""

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.configs import check_room, check_servable_model, png_file, run_tool  # noqa: E402
from bench.serve_load import start_server  # noqa: E402
from runtime.checkpoint import existing_checkpoint, load_model  # noqa: E402
from runtime.errors import OneLineErrorParser, UsageError, positive_int  # noqa: E402

# No window, no sandbox (it may run as root), and none of the browser's own calls to the network.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ATTEMPTS = 20
PAGE_PROMPT = "ROMEO:\nBut soft, what light through yonder"  # two full blocks of 16, which the copies share


def attempt(page) -> bytes | None:
    """Send the three requests and take a picture once the pool shows them all decoding; None where a text had
    already ended when it was taken."""
    page.evaluate("document.getElementById('outputs').replaceChildren()")
    page.click("#send")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and page.evaluate(
            "document.querySelectorAll('#jobs tr[data-state=decoding]').length") < 3:
        time.sleep(0.005)
    picture = page.screenshot(full_page=True)
    drawing = page.evaluate("[...document.querySelectorAll('.card .meta')].filter(m => "
                            "m.textContent.endsWith('drawing')).length")
    while page.evaluate("document.querySelectorAll('#jobs tr[data-state=decoding]').length"):
        time.sleep(0.05)  # the next attempt starts on an idle pool
    return picture if drawing == 3 else None


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=existing_checkpoint, required=True, help="a run directory or .pt file")
    parser.add_argument("--out", type=png_file, required=True, help="the PNG file to write")
    parser.add_argument("--max-tokens", type=positive_int, default=85)
    args = parser.parse_args()
    model = load_model(args.checkpoint)[0]
    check_servable_model(f"--checkpoint {args.checkpoint}", model)
    check_room("--max-tokens", args.max_tokens, model.config.block_size, len(PAGE_PROMPT))
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise UsageError("the picture needs Playwright: pip install playwright") from None
    if shutil.which("chromium") is None:
        raise UsageError("the picture needs a browser: apt-get install chromium")
    server, url = start_server(args.checkpoint, "--threads", "1")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.goto(url)
            page.fill("#prompt", PAGE_PROMPT)
            page.fill("#maxtokens", str(args.max_tokens))
            page.fill("#copies", "3")
            for _ in range(ATTEMPTS):  # the page polls the pool: a picture may catch it behind the texts
                picture = attempt(page)
                if picture:
                    args.out.write_bytes(picture)
                    break
            else:
                raise UsageError(f"no picture in {ATTEMPTS} attempts showed the three requests decoding: give a "
                                 f"larger --max-tokens, or a larger model")
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_tool(main)
