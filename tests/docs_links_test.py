"""The README and the measurement record under docs/ link each other: every relative link names a
file that exists and, where it names a heading, a heading of that file (GitHub's anchors)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
LINK = re.compile(r'\]\(([^)\s]+)\)')


def anchors(page: pathlib.Path) -> set[str]:
  """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
  text = re.sub(r'```.*?```', '', page.read_text(), flags=re.S)  # '#' in code is no heading.
  return {re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')
          for heading in re.findall(r'^#+\s+(.*)$', text, re.M)}


def test_the_anchor_rule():
  page = ROOT / 'docs' / 'measurements' / 'benchmarks.md'
  assert 'mtp-against-transformers-and-llamacpp-benchmarkspeer' in anchors(page)


@pytest.mark.parametrize('page', PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
  broken = []
  for target in LINK.findall(page.read_text()):
    if re.match(r'[a-z]+:', target):  # https:, mailto: and the like.
      continue
    path, _, anchor = target.partition('#')
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
      broken.append(f'{target} (no such file)')
    elif anchor and linked.suffix == '.md' and anchor not in anchors(linked):
      broken.append(f'{target} (no such heading)')
  assert not broken, f'{page.relative_to(ROOT)}: {broken}'
