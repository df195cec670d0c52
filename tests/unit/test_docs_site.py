"""The documentation site's checks (`tools/check_docs.py`, run by `make docs` on the whole site after the suite in
.ci/run): a missing page or link is caught; every page renders in a browser (on request)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.process, pytest.mark.docs]

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("pdoc", reason="the docs extra is not installed (pip install -e '.[docs]'; make test installs it)")
pytest.importorskip("markdown", reason="the docs extra is not installed (pip install -e '.[docs]')")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it, less the functions' source listings (4x faster): only for the
    browser check here. `make docs` (which .ci/run runs after the suite) builds the whole site and runs
    `missing_pages` and `broken_links` on it: a 30-s build is not repeated inside the suite's time."""
    out = tmp_path_factory.mktemp("docs") / "site"
    _tool("build_docs").build(out, show_source=False)
    return out


def _fake_site(root: Path, guides: list[str], modules: list[str], distopt: str = "class DistOpt") -> Path:
    (root / "docs").mkdir(parents=True)
    links = "".join(f'<a href="docs/{g}.html">{g}</a>' for g in guides)
    (root / "index.html").write_text(f'<a href="api/troupe.html">API</a>{links}')
    for g in guides:
        (root / "docs" / f"{g}.html").write_text("<p>guide</p>")
    for m in modules:
        page = root / "api" / f"{m}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(distopt if m == "troupe/distopt" else "<p>module</p>")
    return root


def test_the_site_check_names_a_missing_guide_module_and_class(tmp_path):
    check = _tool("check_docs")
    guides = tmp_path / "md"
    guides.mkdir()
    for g in ("guide", "sharding"):
        (guides / f"{g}.md").write_text("# x")
    whole = _fake_site(tmp_path / "whole", ["guide", "sharding"], list(check.API_MODULES))
    assert check.missing_pages(whole, guides) == []
    partial = _fake_site(tmp_path / "partial", ["guide"], ["troupe", "troupe/distopt"], distopt="<p>nothing</p>")
    assert check.missing_pages(partial, guides) == [
        "docs/sharding.md: not on the site, or not linked from index.html",
        "api/troupe/runtime/launch.html: missing", "api/troupe/script/data.html: missing",
        "api/troupe/distopt.html: does not document DistOpt"]


def test_link_check_catches_a_missing_page_and_anchor(tmp_path):
    (tmp_path / "a.html").write_text('<p id="here"><a href="b.html">b</a> <a href="#gone">x</a> <a href="#here">y</a>'
                                     ' <img src="c.png"> <a href="https://example.org/">ext</a></p>')
    broken = _tool("check_docs").broken_links(tmp_path)
    assert [line.split(" (")[0] for line in broken] == ["a.html: b.html", "a.html: #gone", "a.html: c.png"]


@pytest.mark.skipif(not os.environ.get("TROUPE_DOCS_BROWSER"),
                    reason="`make docs-check` loads every page in Chromium (.ci/run runs it after the suite); "
                           "TROUPE_DOCS_BROWSER=1 runs it here too (23 s)")
def test_every_page_renders_in_headless_chromium(site):
    pytest.importorskip("playwright", reason="playwright is not installed (the docs extra installs it)")
    check = _tool("check_docs")
    chromium = check.find_chromium()
    if chromium is None:
        pytest.skip("no Chromium executable (apt-get install chromium, or set CHROMIUM=/path/to/chrome)")
    assert check.browser_errors(site, chromium) == []
