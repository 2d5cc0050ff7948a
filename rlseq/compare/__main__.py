"""``python -m rlseq.compare``: see :mod:`rlseq.compare.cli`."""

import warnings

from rlseq.compare.cli import main


def _format_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001 - warnings' signature
    return f"rlseq.compare: warning: {message}\n"


warnings.formatwarning = _format_warning  # the CLI's own warnings read as messages, not as source locations
raise SystemExit(main())
