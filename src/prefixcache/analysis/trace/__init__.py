"""Request traces, format v1: the format (``format.py``), the one writer (``writer.py``), the
line reader (``reader.py``), the columnar loader (``load.py``), tokenizers (``tokenize.py``),
block-key chains (``keychains.py``), cache-busting spans (``spans.py``), synthetic traces
(``synth.py``) and importers of public and provider logs (``importers.py``)."""

from __future__ import annotations

from prefixcache.analysis.trace.format import FORMAT_VERSION, TOKEN_DTYPE, TraceFormatError
from prefixcache.analysis.trace.load import Trace, load_trace
from prefixcache.analysis.trace.reader import count_lines, iter_lines
from prefixcache.analysis.trace.tokenize import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    render_messages,
)
from prefixcache.analysis.trace.writer import TraceWriter

__all__ = [
    "FORMAT_VERSION",
    "TOKEN_DTYPE",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "Trace",
    "TraceFormatError",
    "TraceWriter",
    "count_lines",
    "iter_lines",
    "load_tokenizer",
    "load_trace",
    "render_messages",
]
