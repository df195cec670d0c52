"""Check the built documentation site: every internal link resolves, every page renders in a browser.

    python tools/check_docs.py [SITE]           # default build/docs; links, then a headless browser
    python tools/check_docs.py SITE --links     # the link check only (no browser needed)

The link check parses every HTML page and fails on an internal href/src whose file is missing
or whose #fragment names no id on the target page. The browser check loads every page in
headless Chromium through Playwright (`pip install 'torch-troupe[docs]'` plus a Chromium:
Debian's `chromium` package, or `python -m playwright install chromium`) and fails on a
console error, an uncaught page error, a failed request, a non-2xx response or an empty page;
then on one API page at each folder depth it types a query into pdoc's search box and fails
unless the results appear and each result's link leads to an existing page and anchor
(following the expected one in the browser too). Without Playwright or a Chromium it says so
in one line and exits 2 (`.ci/run` runs this check only where it installed a Chromium).
"""

from __future__ import annotations

import os
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

EXTERNAL = ("http", "https", "mailto", "javascript", "data")
SEARCH = ("DistOpt", "troupe/distopt.html#DistOpt")
"""A query for pdoc's search box, and the result (relative to api/) it must list and lead to."""


class _Page(HTMLParser):
    """The ids (anchors) a page defines and the local URLs it refers to."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)
            elif name in ("href", "src") and urlsplit(value).scheme not in EXTERNAL:
                self.refs.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def broken_links(site: Path) -> list[str]:
    """One line per internal link that does not resolve: 'page: url (why)'."""
    site = site.resolve()
    pages = {p: _parse(p) for p in sorted(site.rglob("*.html"))}
    problems = []
    for page, parsed in pages.items():
        for ref in parsed.refs:
            url = urlsplit(ref)
            target = page if not url.path else (page.parent / unquote(url.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(site)}: {ref}"
            if site != target and site not in target.parents:
                problems.append(f"{where} (points outside the site)")
            elif not target.is_file():
                problems.append(f"{where} (no such file)")
            elif url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(url.fragment) not in ids:
                    problems.append(f"{where} (no id {url.fragment!r} on {target.relative_to(site)})")
    return problems


def find_chromium() -> str | None:
    """A Chromium executable: $CHROMIUM, Debian's package, or None (Playwright's own download is tried last)."""
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def browser_errors(site: Path, executable: str | None = None) -> list[str]:
    """Load every page in headless Chromium; one line per console error, page error or failed request."""
    from playwright.sync_api import sync_playwright

    site = site.resolve()
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(headless=True, executable_path=executable or find_chromium(),
                                     args=["--no-sandbox"])
        page = browser.new_page()
        current = {"name": ""}

        def note(what: str) -> None:
            problems.append(f"{current['name']}: {what}")

        page.on("console", lambda m: m.type == "error" and note(f"console error: {m.text}"))
        page.on("pageerror", lambda e: note(f"page error: {e}"))
        page.on("requestfailed", lambda r: note(f"request failed: {r.url} ({r.failure})"))
        page.on("response", lambda r: r.status >= 400 and note(f"HTTP {r.status}: {r.url}"))
        for path in sorted(site.rglob("*.html")):
            current["name"] = str(path.relative_to(site))
            page.goto(path.as_uri(), wait_until="load", timeout=30_000)
            if 'http-equiv="refresh"' in path.read_text(errors="replace"):
                # pdoc's api/index.html: its redirect starts after "load"; let it land, or it interrupts the
                # next page's navigation (seen once in CI's docs-check)
                page.wait_for_url(lambda url, start=path.as_uri(): url != start, timeout=30_000)
                page.wait_for_load_state("load")
            if not _has_text(page):
                note("rendered an empty body")
        for path in _one_page_per_depth(site / "api"):
            current["name"] = f"{path.relative_to(site)} (search)"
            for line in search_errors(page, path, site):
                note(line)
        browser.close()
    return problems


def _one_page_per_depth(api: Path) -> list[Path]:
    """The first API page (by name) in each folder depth: the search's links are relative to the page."""
    first: dict[int, Path] = {}
    for path in sorted(api.rglob("*.html")):
        if path.name != "index.html":  # pdoc's index only redirects to the top module
            first.setdefault(len(path.relative_to(api).parts), path)
    return [first[depth] for depth in sorted(first)]


def search_errors(page, path: Path, site: Path) -> list[str]:
    """Search pdoc's index from the API page at `path`; one line per thing that does not work."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    query, expected = SEARCH
    page.goto(path.as_uri(), wait_until="load", timeout=30_000)
    page.fill("input[type=search]", query)  # its focus loads search.js, its input runs the query
    try:
        page.wait_for_selector(".search-result a", timeout=30_000)
    except PlaywrightTimeout:
        shown = page.evaluate("document.querySelector('main.pdoc').innerText.slice(0, 200)")
        return [f"searching {query!r} showed no result: {shown!r}"]
    hrefs = page.eval_on_selector_all(".search-result a", "links => links.map(a => a.href)")
    problems = [f"search result {href} (not a file of the site)" for href in hrefs if _missing(href, site)]
    want = (site / "api" / expected.split("#")[0]).resolve().as_uri() + "#" + expected.split("#")[1]
    if want not in hrefs:
        return problems + [f"searching {query!r} did not list {expected}: {hrefs}"]
    page.click(f".search-result a[href$='{expected.split('/')[-1]}']")
    page.wait_for_load_state("load")
    anchor = expected.split("#")[1]
    if page.url != want or not page.evaluate("id => document.getElementById(id) !== null", anchor):
        problems.append(f"following the result for {expected} reached {page.url} without its anchor")
    return problems


def _missing(href: str, site: Path) -> bool:
    """Whether a file:// link misses its page or its #anchor."""
    url = urlsplit(href)
    target = Path(url2pathname(url.path)).resolve()
    if url.scheme != "file" or site.resolve() not in target.parents or not target.is_file():
        return True
    return bool(url.fragment) and unquote(url.fragment) not in _parse(target).ids


def _has_text(page) -> bool:
    """Whether the page shows any text (after a meta-refresh redirect, on the page it led to)."""
    from playwright.sync_api import Error

    for _ in range(3):
        try:
            return bool(page.evaluate("document.body !== null && document.body.innerText.trim().length > 0"))
        except Error:  # a meta refresh navigated away while evaluating: wait for the new page
            page.wait_for_load_state("load")
    return False


def _no_browser() -> str | None:
    """Why the browser check cannot run here, or None."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[docs]')"
    if find_chromium() is None and not _playwright_has_chromium():
        return "no Chromium (apt-get install chromium, or set CHROMIUM=/path/to/chrome)"
    return None


def _playwright_has_chromium() -> bool:
    """Whether `python -m playwright install chromium` has put its own browser in place."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        return Path(pw.chromium.executable_path).is_file()


API_MODULES = ("troupe", "troupe/distopt", "troupe/runtime/launch", "troupe/script/data")
"""API pages the site must have (a sample: pdoc leaves out a module it cannot import)."""


def missing_pages(site: Path, guides: Path) -> list[str]:
    """What the index does not link to or the site lacks: the API reference's root, every guide of
    `guides` (docs/*.md), the `API_MODULES`, and DistOpt on its page."""
    index = (site / "index.html").read_text()
    problems = [] if 'href="api/troupe.html"' in index else ["index.html: no link to api/troupe.html"]
    for md in sorted(guides.glob("*.md")):
        if f'href="docs/{md.stem}.html"' not in index or not (site / "docs" / f"{md.stem}.html").is_file():
            problems.append(f"docs/{md.name}: not on the site, or not linked from index.html")
    api = site / "api"
    modules = {p.relative_to(api).with_suffix("").as_posix() for p in api.rglob("*.html")} if api.is_dir() else set()
    problems += [f"api/{m}.html: missing" for m in API_MODULES if m not in modules]
    distopt = api / "troupe" / "distopt.html"
    if distopt.is_file() and "DistOpt" not in distopt.read_text():
        problems.append("api/troupe/distopt.html: does not document DistOpt")
    return problems


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    site = Path(args[0]) if args else Path(__file__).resolve().parents[1] / "build" / "docs"
    if not (site / "index.html").is_file():
        print(f"no site at {site}: build it first (make docs)", file=sys.stderr)
        return 2
    problems = missing_pages(site, Path(__file__).resolve().parents[1] / "docs") + broken_links(site)
    npages = len(list(site.rglob("*.html")))
    print(f"links: {npages} pages, {len(problems)} broken")
    missing = None if "--links" in argv else _no_browser()
    if "--links" not in argv and missing is None:
        errors = browser_errors(site, find_chromium())
        print(f"browser: {npages} pages loaded in headless Chromium, pdoc's search tried, {len(errors)} errors")
        problems += errors
    for line in problems:
        print(line, file=sys.stderr)
    if missing:
        print(f"browser: cannot check, {missing}", file=sys.stderr)
        return 2
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
