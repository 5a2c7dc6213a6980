#!/usr/bin/env python3
"""Checks that documentation references resolve.

    check_links.py REPO_ROOT

1. Public headers (dist/include, engine/*/include, offload/include): every *.md file named in
   a comment must exist at the repository root or under docs/ ("docs/CLUSTER.md" and
   "ARCHITECTURE.md" both resolve: the second to docs/ARCHITECTURE.md).
2. README.md and docs/**/*.md: every relative link [text](target) or [ref]: target, outside
   code blocks and code spans, must name an existing file or directory (relative to the
   page), and an #anchor into a .md page must be one of that page's headings.

Prints each failure as FILE:LINE: what is missing, and exits 1 if there is any.
"""
import glob
import os
import re
import sys

MD_NAME = re.compile(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md\b")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def header_comments(text):
    """(line, comment text) for every // and /* */ comment, skipping string and char literals."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append((line, text[i:end]))
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            for k, part in enumerate(text[i:end].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, end)
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def check_headers(root, failures):
    patterns = ["dist/include/**/*.h", "engine/*/include/**/*.h", "offload/include/**/*.h"]
    headers = sorted({h for p in patterns for h in glob.glob(os.path.join(root, p), recursive=True)})
    mentions = 0
    for header in headers:
        rel = os.path.relpath(header, root)
        with open(header, encoding="utf-8") as f:
            comments = header_comments(f.read())
        for line, comment in comments:
            for name in MD_NAME.findall(comment):
                mentions += 1
                if name.startswith("./"):
                    name = name[2:]
                if not any(os.path.isfile(os.path.join(root, base, name)) for base in ("", "docs")):
                    failures.append(f"{rel}:{line}: names {name}, which is found neither at the "
                                    f"repository root nor under docs/")
    return len(headers), mentions


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def page_lines(path):
    """(line number, text) of a markdown page outside fenced code blocks, code spans removed."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    fence = None
    for number, text in enumerate(lines, start=1):
        m = FENCE.match(text)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                fence = None
            continue
        yield number, re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def anchors(path, cache={}):
    if path not in cache:
        seen, found = {}, set()
        for _, text in page_lines(path):
            m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", text)
            if not m:
                continue
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        cache[path] = found
    return cache[path]


def check_pages(root, failures):
    pages = [os.path.join(root, "README.md")] + sorted(
        glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
    links = 0
    for page in pages:
        if not os.path.isfile(page):
            continue
        rel = os.path.relpath(page, root)
        for number, text in page_lines(page):
            targets = INLINE_LINK.findall(text)
            m = REF_DEF.match(text)
            if m:
                targets.append(m.group(1))
            for target in targets:
                if SCHEME.match(target) or target.startswith("//"):
                    continue  # http:, https:, mailto:, ...
                links += 1
                path, _, anchor = target.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                if not os.path.exists(dest):
                    failures.append(f"{rel}:{number}: links to {target}, but "
                                    f"{os.path.relpath(dest, root)} does not exist")
                elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                    failures.append(f"{rel}:{number}: links to {target}, but "
                                    f"{os.path.relpath(dest, root)} has no heading with anchor #{anchor}")
    return len(pages), links


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.abspath(sys.argv[1])
    failures = []
    n_headers, mentions = check_headers(root, failures)
    n_pages, links = check_pages(root, failures)
    for f in failures:
        print(f, file=sys.stderr)
    if failures:
        print(f"{len(failures)} broken documentation reference(s)", file=sys.stderr)
        return 1
    print(f"{mentions} .md names in the comments of {n_headers} public headers and "
          f"{links} relative links in {n_pages} pages resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
