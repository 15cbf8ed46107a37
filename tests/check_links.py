#!/usr/bin/env python3
"""Checks that the repository's documents only point inside the repository.

For README.md, CHANGELOG.md, docs/*.md, bench/README.md and bench/results/README.md (or the
files given on the command line, relative to the repository root):
  - every Markdown link [text](target) and reference definition [id]: target is relative,
    resolves inside the repository and exists; a #fragment names a heading of the target
    Markdown file (GitHub's heading ids);
  - no web address (http://, https://, ftp://, mailto:, //host; a local server address such as
    http://127.0.0.1:8080 or localhost:8080 in an example is not one), no reference to ../shared
    and no ../ path out of the repository appears anywhere in the text (../ paths in prose and
    code are read from the repository root, links from the document's folder);
  - every path in backticks (inline code and fenced code blocks) that starts with one of the
    repository's top-level folders exists ({a,b} alternatives and * globs are expanded; such
    paths are read from the repository root), except the file an example command writes (the
    word after -o, --out, --output, --json, > or >>). A result file that was removed from the
    tree is named without its folder (it is in git history);
  - README.md has at most 200 lines, no commit hashes (7-40 hex digits with both digits and
    letters) and no result-file names (files under bench/results/ or docs/results/).

Python standard library only. Exit status 0 when every check passes, 1 otherwise.
"""
import glob
import os
import re
import sys

ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_FILES = ["README.md", "CHANGELOG.md", "bench/README.md", "bench/results/README.md"]
DEFAULT_GLOBS = ["docs/*.md"]  # hand-written documents (docs/results/ holds generated reports)
README_MAX_LINES = 200
# Folders whose paths in backticks must exist. models/ and build*/ hold generated files.
TOP_DIRS = {"src", "tools", "bench", "tests", "fuzz", "docs", "scripts", "configs", "python",
            "include", ".github"}
RESULT_DIRS = ["bench/results", "docs/results"]

FENCE_RE = re.compile(r"^(\s*)(```|~~~)")
INLINE_CODE_RE = re.compile(r"(`+)(.+?)\1")
LINK_RE = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?"
                     r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^()]*\)))?\s*\)")
REFDEF_RE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
WEB_RE = re.compile(r"\b(?:https?|ftp)://|\bmailto:|\bwww\.[a-z0-9-]+\.[a-z]", re.I)
# A local server address in an example (curl localhost:8080/..., base_url="http://127.0.0.1:8080/v1").
LOCAL_URL_RE = re.compile(r"\b(?:https?://)?(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\])(?::\d+)?(?=[/\s\"'`)]|$)",
                          re.I)
# A ../ path in prose (outside links and code), read from the repository root.
PROSE_UP_RE = re.compile(r"(?<![\w./-])\.\./[\w.\-/]*")
OUTPUT_FLAGS = {"-o", "--out", "--output", "--json", ">", ">>"}
SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEX_RE = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
COMMIT_WORD_RE = re.compile(r"\bcommits?\s+([0-9a-f]{7,40})(?![0-9A-Za-z_])", re.I)
PATH_TOKEN_RE = re.compile(r"^[\w.\-/{},*?\[\]+@]+$")


def split_code(lines):
    """Yields (line_no, text, in_fence) with fence marker lines dropped."""
    fence = None
    for i, line in enumerate(lines, 1):
        m = FENCE_RE.match(line)
        if m:
            if fence is None:
                fence = m.group(2)
                continue
            if m.group(2) == fence:
                fence = None
                continue
        yield i, line, fence is not None


def slugify(heading):
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


_anchor_cache = {}


def anchors_of(path):
    if path not in _anchor_cache:
        ids, seen = set(), {}
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        for _, line, in_fence in split_code(lines):
            m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
            if in_fence or not m:
                continue
            base = slugify(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
        for m in re.finditer(r"<a\s+(?:name|id)=\"([^\"]+)\"", "\n".join(lines)):
            ids.add(m.group(1))
        _anchor_cache[path] = ids
    return _anchor_cache[path]


def inside_root(path):
    real = os.path.realpath(path)
    return real == ROOT or real.startswith(ROOT + os.sep)


def rel(path):
    return os.path.relpath(os.path.realpath(path), ROOT)


def expand_braces(s):
    m = re.search(r"\{([^{}]*)\}", s)
    if not m:
        return [s]
    out = []
    for alt in m.group(1).split(","):
        out += expand_braces(s[:m.start()] + alt + s[m.end():])
    return out


def check_link(doc, line_no, target, errors):
    where = f"{doc}:{line_no}"
    if not target:
        errors.append(f"{where}: empty link target")
        return
    if SCHEME_RE.match(target) or target.startswith("//"):
        errors.append(f"{where}: link leaves the repository: {target}")
        return
    path_part, _, fragment = target.partition("#")
    path_part = path_part.split("?", 1)[0]
    if path_part.startswith("/"):
        errors.append(f"{where}: absolute link (use a path relative to the file): {target}")
        return
    doc_dir = os.path.dirname(os.path.join(ROOT, doc))
    dest = os.path.normpath(os.path.join(doc_dir, path_part)) if path_part else os.path.join(ROOT, doc)
    if not inside_root(dest):
        errors.append(f"{where}: link leaves the repository: {target}")
        return
    if not os.path.exists(dest):
        errors.append(f"{where}: link target does not exist: {target} (-> {rel(dest)})")
        return
    if fragment and dest.endswith(".md") and os.path.isfile(dest):
        if fragment not in anchors_of(dest):
            errors.append(f"{where}: no heading '#{fragment}' in {rel(dest)}")


def check_code_path(doc, line_no, token, errors):
    """A token from inline code or a code block; checks it when it names a repository path."""
    tok = token.strip("\"'(),;:!").rstrip(".")  # a leading ../ keeps its dots
    if "=" in tok:
        tok = tok.rsplit("=", 1)[1]
    if tok.startswith("../"):
        if not inside_root(os.path.join(ROOT, tok)):
            errors.append(f"{doc}:{line_no}: path outside the repository: {tok}")
        return
    if "/" not in tok or not PATH_TOKEN_RE.match(tok):
        return
    if tok.split("/", 1)[0] not in TOP_DIRS:
        return
    for cand in expand_braces(tok):
        full = os.path.join(ROOT, cand)
        if any(c in cand for c in "*?["):
            if not glob.glob(full):
                errors.append(f"{doc}:{line_no}: no file matches `{cand}`")
        elif not os.path.exists(full):
            errors.append(f"{doc}:{line_no}: `{cand}` does not exist in the repository")
    return True


def result_file_names():
    names = set()
    for d in RESULT_DIRS:
        full = os.path.join(ROOT, d)
        if os.path.isdir(full):
            for name in os.listdir(full):
                if os.path.isfile(os.path.join(full, name)) and len(name) > 4:
                    names.add(name)
    return names


def check_doc(doc):
    errors = []
    counts = {"links": 0, "paths": 0}
    path = os.path.join(ROOT, doc)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()

    for line_no, line in enumerate(lines, 1):
        if WEB_RE.search(LOCAL_URL_RE.sub("", line)):
            errors.append(f"{doc}:{line_no}: web address (no link may leave the repository)")
        if "../shared" in line:
            errors.append(f"{doc}:{line_no}: reference to ../shared (outside the repository)")

    def check_tokens(line_no, tokens):
        for i, token in enumerate(tokens):
            if i > 0 and tokens[i - 1] in OUTPUT_FLAGS:
                continue  # the file an example command writes
            if check_code_path(doc, line_no, token, errors):
                counts["paths"] += 1

    for line_no, line, in_fence in split_code(lines):
        if in_fence:
            check_tokens(line_no, line.split())
            continue
        for m in INLINE_CODE_RE.finditer(line):
            check_tokens(line_no, m.group(2).split())
        prose = INLINE_CODE_RE.sub("", line)
        for m in PROSE_UP_RE.finditer(LINK_RE.sub("", prose)):
            if not inside_root(os.path.join(ROOT, m.group(0))):
                errors.append(f"{doc}:{line_no}: path outside the repository: {m.group(0)}")
        for m in LINK_RE.finditer(prose):
            counts["links"] += 1
            check_link(doc, line_no, m.group(2), errors)
        m = REFDEF_RE.match(prose)
        if m:
            counts["links"] += 1
            check_link(doc, line_no, m.group(1), errors)

    if os.path.basename(doc) == "README.md" and os.path.dirname(doc) == "":
        if len(lines) > README_MAX_LINES:
            errors.append(f"{doc}: {len(lines)} lines (at most {README_MAX_LINES})")
        names = result_file_names()
        for line_no, line in enumerate(lines, 1):
            for m in HEX_RE.finditer(line):
                h = m.group(0)
                if re.search(r"[0-9]", h) and re.search(r"[a-f]", h):
                    errors.append(f"{doc}:{line_no}: looks like a commit hash: {h}")
            for m in COMMIT_WORD_RE.finditer(line):  # digits-only hashes after "commit"
                if not re.search(r"[a-f]", m.group(1)):
                    errors.append(f"{doc}:{line_no}: looks like a commit hash: {m.group(1)}")
            for d in RESULT_DIRS:
                if re.search(re.escape(d) + r"/[\w.{*-]", line):
                    errors.append(f"{doc}:{line_no}: names a file under {d}/ (link docs/results.md)")
            for name in names:
                if name in line:
                    errors.append(f"{doc}:{line_no}: names the result file {name}")
    return errors, counts, len(lines)


def default_docs():
    docs = list(DEFAULT_FILES)
    for pattern in DEFAULT_GLOBS:
        docs += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    return docs


def main(argv):
    docs = argv[1:] or default_docs()
    all_errors = []
    for doc in docs:
        if not os.path.isfile(os.path.join(ROOT, doc)):
            all_errors.append(f"{doc}: missing")
            continue
        errors, counts, n_lines = check_doc(doc)
        status = "ok" if not errors else f"{len(errors)} problem(s)"
        print(f"{doc}: {n_lines} lines, {counts['links']} links, {counts['paths']} repository "
              f"paths in code: {status}")
        all_errors += errors
    for e in all_errors:
        print("  " + e)
    print("check_links: " + ("all links stay inside the repository and resolve" if not all_errors
                             else f"FAILED ({len(all_errors)} problem(s))"))
    return 1 if all_errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
