"""Rebuild kjv_genesis_exodus.txt from Debian's bible-kjv packages (how the shipped file was made).

    apt-get install bible-kjv bible-kjv-text
    python examples/data/make_kjv.py

The text is the King James Version (1611) of Genesis and Exodus, as the Bible Retrieval System
database in Debian's bible-kjv-text stores it; its copyright file says the copyright of the KJV
text has expired. Verse numbers are dropped, one verse a line, a blank line and a heading
("Genesis 1") before each chapter.
"""

import pathlib
import re
import subprocess

BOOKS = ("gen1:1-gen50:26", "exo1:1-exo40:38")
OUT = pathlib.Path(__file__).with_name("kjv_genesis_exodus.txt")


def main() -> None:
    lines = []
    for span in BOOKS:
        text = subprocess.run(["bible", "-l", "100000", span], check=True, capture_output=True, text=True).stdout
        for line in text.splitlines():
            verse = re.match(r"^\s+\d+ (.*)$", line)
            if verse:
                lines.append(verse.group(1).strip())
            elif line.strip():
                lines += ["", line.strip()]
    OUT.write_text("\n".join(lines).lstrip() + "\n", encoding="ascii")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
