"""Build troupe's documentation site: the API reference (pdoc) plus the hand-written guides.

    python tools/build_docs.py [OUT]          # default build/docs; `make docs` runs this

Layout of OUT (mirrors the repository, so the guides' relative links keep working):

    index.html             links to the API reference, the README and every guide
    README.html            README.md
    docs/NAME.html         docs/NAME.md (images and data files they link are copied beside them)
    api/troupe.html ...    one page per module, from the docstrings

Importing troupe's modules starts no process and needs no network; `__main__` is skipped.
"""

from __future__ import annotations

import html
import pkgutil
import re
import shutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"""(?P<attr>href|src)="(?P<url>[^"#?:]+\.md)(?P<frag>#[^"]*)?\"""")
LOCAL_REF = re.compile(r"""(?:href|src)="(?P<url>[^"#?]+)""")
SELF_LINK = re.compile(r'<a href="#(?P<id>[^"]+)">(?P<text>[^<]*)</a>')
STYLE = """
body { font: 16px/1.5 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
pre { background: #f6f8fa; padding: .8rem; overflow-x: auto; } code { font-size: 90%; }
table { border-collapse: collapse; margin: 1rem 0; } th, td { border: 1px solid #ccc; padding: .2rem .5rem; }
img { max-width: 100%; } nav { border-bottom: 1px solid #ddd; padding-bottom: .5rem; margin-bottom: 1rem; }
"""


def modules(package: str = "troupe") -> list[str]:
    """Every public module of `package`, parents before children (pdoc renders each)."""
    pkg = __import__(package)
    names = [package]
    for m in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
        if not any(part.startswith("_") for part in m.name.split(".")):
            names.append(m.name)
    return sorted(names)


def unlink_missing_members(page: Path) -> None:
    """pdoc links a name in a docstring to `#Class.member` even when the member is inherited from
    torch and listed without an anchor of its own; such a link becomes plain code."""
    text = page.read_text(encoding="utf-8")
    ids = set(re.findall(r'\bid="([^"]+)"', text))
    fixed = SELF_LINK.sub(lambda m: m[0] if m["id"] in ids else m["text"], text)
    if fixed != text:
        page.write_text(fixed, encoding="utf-8")


def github_slug(text: str, separator: str = "-") -> str:
    """GitHub's heading anchors, so `guide.md#some-heading` links work on GitHub and in the site alike."""
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", html.unescape(text).strip().lower()).replace(" ", separator)


def render_markdown(src: Path, out: Path, depth: int, title: str) -> str:
    """`src` as one HTML page at `out`; links to .md files become links to the rendered pages."""
    import markdown

    body = markdown.markdown(
        src.read_text(encoding="utf-8"),
        extensions=["fenced_code", "tables", "toc", "sane_lists"],
        extension_configs={"toc": {"slugify": github_slug}},
    )
    body = LINK.sub(lambda m: f'{m["attr"]}="{m["url"][:-3]}.html{m["frag"] or ""}"', body)
    up = "../" * depth
    nav = f'<nav><a href="{up}index.html">troupe docs</a> · <a href="{up}api/troupe.html">API reference</a></nav>'
    page = (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head>\n<body>{nav}\n{body}\n</body></html>\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return body


def copy_local_files(body: str, src_dir: Path, out_dir: Path) -> None:
    """Copy the repository files a page links (images, JSON lines) to the same relative place in the site."""
    for m in LOCAL_REF.finditer(body):
        url = m["url"]
        if url.endswith((".md", ".html")) or url.startswith("/"):
            continue
        source = (src_dir / url).resolve()
        if source.is_file() and ROOT in source.parents:
            target = out_dir / source.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


def inline_code(text: str) -> str:
    """Markdown's `code` spans of a heading as HTML."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def title_of(md: Path) -> str:
    first = next((line for line in md.read_text(encoding="utf-8").splitlines() if line.startswith("# ")), None)
    return first[2:].strip() if first else md.stem


def build(out: Path, show_source: bool = True) -> Path:
    """Write the whole site under `out` (replacing what was there); returns the index page.

    `show_source=False` leaves out each function's highlighted source (a 4x faster build).
    """
    import pdoc

    if out.exists():
        shutil.rmtree(out)
    pdoc.render.configure(docformat="markdown", footer_text="troupe", show_source=show_source)
    with warnings.catch_warnings():
        # Every module is named so none is missed; pdoc warns when a package already pulled one in.
        warnings.filterwarnings("ignore", message="The module specification", category=UserWarning)
        # tensorboard's SummaryWriter is imported only for type checking; the annotation stays text.
        warnings.filterwarnings("ignore", message="Error parsing type annotation", category=UserWarning)
        pdoc.pdoc(*modules(), output_directory=out / "api")
    for page in (out / "api").rglob("*.html"):
        unlink_missing_members(page)
    pages = [(ROOT / "README.md", out / "README.html", 0)]
    # "Which regime when" first, then the guides by name.
    guides = sorted((ROOT / "docs").glob("*.md"), key=lambda md: (md.stem != "guide", md.stem))
    pages += [(md, out / "docs" / f"{md.stem}.html", 1) for md in guides]
    items = ['<li><a href="api/troupe.html">API reference</a> (every module, from its docstrings)</li>']
    for src, dst, depth in pages:
        title = title_of(src)
        body = render_markdown(src, dst, depth, title)
        copy_local_files(body, src.parent, out)
        label = "Overview (README)" if src.name == "README.md" else inline_code(html.escape(title))
        items.append(f'<li><a href="{dst.relative_to(out).as_posix()}">{label}</a>'
                     f" <small>({src.relative_to(ROOT).as_posix()})</small></li>")
    index = out / "index.html"
    index.write_text(
        f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>troupe documentation</title>"
        f"<style>{STYLE}</style></head>\n<body><h1>troupe documentation</h1>\n"
        "<p>SINGA-style distributed training on torch.distributed: the API reference and the guides.</p>\n"
        "<ul>\n" + "\n".join(items) + "\n</ul>\n</body></html>\n",
        encoding="utf-8",
    )
    return index


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "docs"
    print(f"wrote {build(target.resolve())}")
