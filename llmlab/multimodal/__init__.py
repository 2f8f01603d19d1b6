"""Image inputs (issue 44's input layer): user-facing forms decoded into checked RGB images.

:mod:`~llmlab.multimodal.media` loads one image from any accepted form (PIL, arrays, bytes,
data URLs, local files under an allowed directory, http(s) through :class:`HttpFetcher`, in
:mod:`~llmlab.multimodal.fetch`);
:mod:`~llmlab.multimodal.inputs` parses vLLM's ``multi_modal_data`` and OpenAI chat content
parts, with ``limit_mm_per_prompt`` and placeholder checks. Errors are :class:`MediaError`
(a ``ValueError``) naming the request field.
"""

from llmlab.multimodal.fetch import FetchError, HttpFetcher
from llmlab.multimodal.inputs import (
    ChatMedia,
    check_limit_mm_per_prompt,
    check_mm_processor_kwargs,
    check_placeholders,
    parse_chat_content,
    parse_multi_modal_data,
)
from llmlab.multimodal.media import (
    MediaError,
    MediaLimits,
    decode_image_bytes,
    load_image,
)

__all__ = [
    "ChatMedia",
    "FetchError",
    "HttpFetcher",
    "MediaError",
    "MediaLimits",
    "check_limit_mm_per_prompt",
    "check_mm_processor_kwargs",
    "check_placeholders",
    "decode_image_bytes",
    "load_image",
    "parse_chat_content",
    "parse_multi_modal_data",
]
