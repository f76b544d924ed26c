"""The documentation site builds strictly (mkdocs.yml: broken links, missing pages, bad anchors
and docstrings the API reference cannot read all fail), offline, and every page is in its nav."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly_offline(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (site / "api.html").read_text()
    for name in ("jkv.load", "jkv.generate", "jkv.Engine", "jkv.ResponseCache", "jkv.SnapKV"):
        assert f'id="{name}"' in api, name
    remote = set()
    for page in site.rglob("*.html"):
        remote |= set(re.findall(r'(?:src|href)="(https?://[^"/]+)', page.read_text()))
    # the theme's "Made with Material" footer link is the only address a page names
    assert remote <= {"https://squidfunk.github.io"}, remote


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(re.findall(r":\s*([\w-]+\.md)$", nav, re.M))
