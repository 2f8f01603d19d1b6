"""The OpenAI-compatible protocol as pydantic models (so ``/openapi.json`` describes it).

Requests take OpenAI's standard fields plus vLLM's extras (``top_k``, ``min_p``,
``repetition_penalty``, ``guided_json``, ``structured_outputs``, ``priority``, ...). Scalars
are strict: ``"16"`` is not a number and ``true`` is not an integer, so a wrong type is a
400 naming the field rather than a silent coercion. Unknown fields are ignored, as vLLM
ignores them. Responses have exactly OpenAI's shape (plus vLLM's ``stop_reason``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo
from pydantic_core import PydanticCustomError

from llmlab.validation import check_json

Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]
Str = Annotated[str, Field(strict=True)]
TokenIds = list[Int]


def _json_value(value: Any, info: ValidationInfo) -> Any:
    """A free-form JSON field (template arguments, earlier tool calls, ``vllm_xargs``) if it
    nests at most ``MAX_JSON_DEPTH`` deep and its keys and strings are valid Unicode: the
    chat template and the tokenizer would otherwise fail on it, or overflow the stack. The
    schemas and tools are checked where they are read, naming their fields
    (``request_params._structured``, ``tools.check_tools``)."""
    try:
        return check_json(info.field_name, value)
    except ValueError as err:
        raise PydanticCustomError("json_value", "{reason}", {"reason": str(err)}) from None


# A free-form JSON object (or list of them) from a client, bounded by _json_value.
JSONObject = Annotated[dict[str, Any], AfterValidator(_json_value)]
JSONObjects = Annotated[list[dict[str, Any]], AfterValidator(_json_value)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors --------------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Response):
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI sends it."""

    error: ErrorInfo


# -- shared request pieces -----------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False


class JsonSchemaFormat(_Request):
    name: Str = "response"
    description: Str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs`` object: exactly one of these constraints."""

    json_: dict[str, Any] | Str | None = Field(default=None, alias="json")
    regex: Str | None = None
    choice: list[Str] | None = None
    grammar: Str | None = None
    json_object: Bool | None = None


class _SamplingFields(_Request):
    """Fields the two generation endpoints share."""

    model: Str | None = None
    frequency_penalty: Float | None = 0.0
    presence_penalty: Float | None = 0.0
    logit_bias: dict[str, Float] | None = None
    n: Int | None = 1
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    user: Str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras
    best_of: Int | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None
    bad_words: list[Str] | None = None
    allowed_token_ids: list[Int] | None = None
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Int | None = None
    truncate_prompt_tokens: Int | None = None
    guided_json: dict[str, Any] | Str | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: Int = 0
    use_beam_search: Bool = False
    # logprob tokens as "token_id:{id}"; None: the server's default
    return_tokens_as_token_ids: Bool | None = None
    # vLLM's free-form arguments for components: SamplingParams.extra_args (llmlab reads
    # "kv_budget", the fraction of its KV a request keeps under a KV press, and "kv_press")
    vllm_xargs: JSONObject | None = None


# -- completions ---------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: list[TokenIds] | TokenIds | list[Str] | Str
    max_tokens: Int | None = 16
    echo: Bool | None = False
    logprobs: Int | None = None
    suffix: Str | None = None
    add_special_tokens: Bool = True


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptLogprob(_Response):
    """One token's logprob at a prompt position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: one entry per prompt token, None for the first, else
# ``{token_id: PromptLogprob}`` (the prompt's token and the top ``prompt_logprobs``).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionStreamChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionChoice(CompletionStreamChoice):
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_Response):
    """One ``data:`` chunk of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# -- chat ----------------------------------------------------------------------------------


class ContentPart(_Request):
    type: Str
    text: Str | None = None


class ChatMessageParam(_Request):
    role: Str
    content: Str | list[ContentPart] | None = None
    name: Str | None = None
    # an assistant's earlier tool calls, and a tool message's answer to one (for the template)
    tool_calls: JSONObjects | None = None
    tool_call_id: Str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: Int | None = None  # deprecated by OpenAI in favour of the next
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Str | dict[str, Any] | None = None
    echo: Bool = False
    chat_template: Str | None = None
    chat_template_kwargs: JSONObject | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(_Response):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatLogProb(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(_Response):
    content: list[ChatLogProbsContent] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    """One ``data:`` chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- models, tokenizer, version ------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmlab"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessageParam] | None = None
    tools: list[dict[str, Any]] | None = None  # shown to the chat template
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: Str | None = None
    chat_template_kwargs: JSONObject | None = None
    return_token_strs: Bool = False


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Str | None = None
    tokens: list[Int]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """``GET /tokenizer_info``: the tokenizer's configuration (vLLM's), its class name and
    whatever else the tokenizer was configured with (special tokens, ``model_max_length``,
    ``chat_template``, ``added_tokens_decoder``, ...)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str


class VersionResponse(_Response):
    version: str
