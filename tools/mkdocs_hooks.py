"""mkdocs hooks (``mkdocs.yml``): the README is the site's home page.

The README links the guides as ``docs/<page>.md`` (right on GitHub) and the guides link the README as
``../README.md``; on the site both are pages of one directory.
"""

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def on_files(files, config):
    files.append(File.generated(config, "index.md", abs_src_path=os.path.join(ROOT, "README.md")))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "index.md":
        return re.sub(r"\]\(docs/", "](", markdown)
    return markdown.replace("](../README.md", "](index.md")
