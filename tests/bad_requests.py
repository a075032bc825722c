"""The worker's bad-input matrix, shared: the worker's own tests send it to a worker
(tests/serving/test_errors.py, test_bad_inputs.py) and the gateway's send it through the
gateway (tests/e2e/test_gateway_limits.py). Every case must be a 4xx, never a 500.

* :data:`BAD_COMPLETION_BODIES`, :data:`BAD_CHAT_BODIES`: ``(body, param, words)`` — valid JSON
  the schema refuses: a 400 naming ``param``, its message containing ``words``;
* :data:`MALFORMED_BODIES`: ``(raw bytes, words)`` — not a JSON object at all;
* :data:`DEEP_BODIES`: raw bodies nested thousands deep (a RecursionError where unchecked).
"""

from __future__ import annotations

PROMPT = "sixteen bytes..!" * 2

BAD_COMPLETION_BODIES = [
    ({"prompt": PROMPT, "max_tokens": "4"}, "max_tokens", "expected `int | null`, got `str`"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": PROMPT, "temperature": 3}, "temperature", "<= 2.0"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p", "> 0.0"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream", "expected `bool`"),
    ({"max_tokens": 2}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts"),
    ({"prompt": [1, "a"]}, "prompt", "token ids"),
    ({"prompt": [1, 2, 256]}, "prompt", "[0, 256)"),
    ({"prompt": PROMPT, "n": 0}, "n", ">= 1"),
    ({"prompt": PROMPT, "n": 17}, "n", "at most 16"),
    ({"prompt": PROMPT, "n": 2, "best_of": 1}, "best_of", "at least n"),
    ({"prompt": PROMPT, "best_of": 3, "stream": True}, "best_of", "cannot be used with stream"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs", "<= 20"),
    ({"prompt": PROMPT, "logprobs": -1}, "logprobs", ">= 0"),
    ({"prompt": PROMPT, "echo": True, "n": 2}, "echo", "not supported with n"),
    ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": PROMPT, "stop": 5}, "stop", "expected `str | array | null`"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty", "<= 2.0"),
    ({"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty", ">= -2.0"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty", "> 0.0"),
    ({"prompt": PROMPT, "min_p": 1.5}, "min_p", "<= 1.0"),
    ({"prompt": PROMPT, "min_tokens": -1}, "min_tokens", ">= 0"),
    ({"prompt": PROMPT, "min_tokens": 5, "max_tokens": 2}, "min_tokens", "more than max_tokens"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias", "<= 100.0"),
    ({"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"prompt": PROMPT, "logit_bias": {"999": 1}}, "logit_bias", "not in the vocabulary"),
    ({"prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"prompt": PROMPT, "stop_token_ids": [3, 4096]}, "stop_token_ids", "not in the vocabulary"),
    ({"prompt": PROMPT, "stop_token_ids": list(range(65))}, "stop_token_ids", "length <= 64"),
    ({"prompt": PROMPT, "cache_reuse": "no"}, "cache_reuse", "expected `bool`"),
]

BAD_CHAT_BODIES = [
    ({"messages": "hi"}, "messages", "expected `array`"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "required"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "'robot' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]",
     "does not accept images"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content",
     "only text and image_url parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function",
     "expected"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "only allowed when"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "<= 20"),
]

MALFORMED_BODIES = [(b'{"prompt": "x",', "not valid JSON"), (b"", "empty"), (b"[1, 2]", "expected `object`"),
                    (b"\xff\xfe", "not valid JSON")]

DEEP_BODIES = [
    b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    b'{"prompt": "x", "tools": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"}",
    b"[" * 100_000,
    b'{"messages": [{"role": "user", "content": "hi"}], "response_format": ' + b"[" * 5000 + b"}",
]
