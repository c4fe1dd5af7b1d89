#!/usr/bin/env python3
"""Regenerates goldens.json, the expected renders of the chat-template tests.

Renders every case below with Python's jinja2 set up the way transformers'
apply_chat_template sets it up (an ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loopcontrols extension, a {% generation %}
tag, the globals raise_exception and strftime_now, and transformers' tojson),
and writes each case with its expected output, or, for a case that must fail,
the error substring the C++ renderer must report (after checking jinja2 fails
too). tests/openai/chat_template_test.cc compares the C++ renderer with it
byte for byte.

    python3 tests/data/chat_templates/make_goldens.py
"""
import datetime
import json
import os

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
# strftime_now's "now" in every case; the C++ test passes the same instant (UTC).
NOW = datetime.datetime(2024, 7, 26, 14, 5, 9, tzinfo=datetime.timezone.utc)


class GenerationTag(Extension):
    """{% generation %}...{% endgeneration %}: renders its body (as a call block)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: NOW.strftime(fmt)
    return env


# ---- conversations ----

SYSTEM = {"role": "system", "content": "  You are terse.\nAnswer in English.  "}
CHAT = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": " Hi, how can I help? "},
    {"role": "user", "content": "What's 2+2?\nAnswer briefly."},
]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}, {
    "type": "function",
    "function": {"name": "now", "description": "The time.", "parameters": {"type": "object", "properties": {}}},
}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Zürich and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
    ]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "{\"temp\": 9}"},
    {"role": "assistant", "content": "Zürich is 21°C, Oslo 9°C."},
]
THINKING = [
    {"role": "user", "content": "Is 7 prime?"},
    {"role": "assistant", "content": "<think>\nDivisors of 7: 1 and 7.\n</think>\n\nYes."},
    {"role": "user", "content": "And 9?"},
    {"role": "assistant", "content": "<think>3 * 3 = 9</think>No: 9 = 3 × 3."},
]
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
STRESS = {
    "name": "  Ada Lovelace  ",
    "items": ["alpha", "beta", "gamma"],
    "mapping": {"k": "v", "b": 2, "a": None},
    "people": [
        {"name": "Ann", "age": 41, "admin": True, "email": "ann@example.com"},
        {"name": "Bob", "age": 29, "admin": False},
        {"name": "Cy", "age": 35, "admin": False, "email": "cy@example.com"},
    ],
}


def ctx(messages, **kw):
    return {"messages": messages, **TOKENS, **kw}


# Each case: name, a template file or inline source, the context; optional
# "error" (a substring of the C++ renderer's error; jinja2 must fail too),
# "limits" (ChatTemplateLimits for the C++ renderer; then jinja2, which has no
# such limits, is not run: "cpp_only").
CASES = [
    # Llama 3
    dict(name="llama3_chat", template="llama3.jinja", context=ctx(CHAT, add_generation_prompt=True)),
    dict(name="llama3_system", template="llama3.jinja", context=ctx([SYSTEM] + CHAT, add_generation_prompt=False)),
    dict(name="llama3_tools", template="llama3.jinja",
         context=ctx(TOOL_TURNS, tools=TOOLS, add_generation_prompt=True, date_string="01 Jan 2025")),
    dict(name="llama3_empty", template="llama3.jinja", context=ctx([], default_system="Be brief.")),
    # ChatML / Qwen
    dict(name="chatml_chat", template="chatml.jinja", context=ctx(CHAT, add_generation_prompt=True)),
    dict(name="chatml_system", template="chatml.jinja", context=ctx([SYSTEM] + CHAT)),
    dict(name="chatml_tools", template="chatml.jinja",
         context=ctx([SYSTEM] + TOOL_TURNS, tools=TOOLS, add_generation_prompt=True)),
    dict(name="chatml_tools_no_system", template="chatml.jinja", context=ctx(TOOL_TURNS, tools=TOOLS)),
    dict(name="chatml_thinking", template="chatml.jinja",
         context=ctx(THINKING + [{"role": "user", "content": "Thanks"}], add_generation_prompt=True,
                     enable_thinking=False)),
    dict(name="chatml_reasoning_after_last_query", template="chatml.jinja",
         context=ctx(THINKING, add_generation_prompt=False)),
    dict(name="chatml_reasoning_field", template="chatml.jinja",
         context=ctx([{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."}])),
    # Mistral
    dict(name="mistral_chat", template="mistral.jinja", context=ctx(CHAT + [{"role": "assistant", "content": "4"}])),
    dict(name="mistral_system", template="mistral.jinja", context=ctx([SYSTEM] + CHAT)),
    dict(name="mistral_alternation", template="mistral.jinja",
         context=ctx([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
         error="raise_exception: Roles must alternate user/assistant after an optional system message; turn 2 is user"),
    dict(name="mistral_unknown_role", template="mistral.jinja",
         context=ctx([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]),
         error="raise_exception: Unknown role: tool"),
    # Gemma
    dict(name="gemma_chat", template="gemma.jinja", context=ctx(CHAT, add_generation_prompt=True)),
    dict(name="gemma_parts", template="gemma.jinja",
         context=ctx([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe this. "}]},
                      {"role": "assistant", "content": "A cat."}])),
    dict(name="gemma_system_refused", template="gemma.jinja", context=ctx([SYSTEM] + CHAT),
         error="raise_exception: Role 'system' is not supported; only user and assistant are"),
    dict(name="gemma_alternation", template="gemma.jinja", context=ctx([CHAT[1]]),
         error="raise_exception: Conversation roles must alternate"),
    # DeepSeek and Phi
    dict(name="deepseek_thinking", template="deepseek.jinja",
         context=ctx([SYSTEM, {"role": "system", "content": "Second system."}] + THINKING, add_generation_prompt=True)),
    dict(name="deepseek_tools", template="deepseek.jinja", context=ctx(TOOL_TURNS, tools=TOOLS)),
    dict(name="phi_chat", template="phi.jinja", context=ctx([SYSTEM] + CHAT, add_generation_prompt=True)),
    dict(name="phi_no_generation_prompt", template="phi.jinja",
         context=ctx([{"role": "system", "content": ""}] + CHAT)),
    # Everything else
    dict(name="stress", template="stress.jinja", context=STRESS),
    dict(name="stress_other_values", template="stress.jinja",
         context={**STRESS, "name": "x", "items": ["one"], "mapping": {"k": 1}, "nothing": 0}),
]

# Inline cases: whitespace rules, scoping and corners, one feature each.
INLINE = {
    "ws_trim_blocks": "a\n{% if true %}\nb\n{% endif %}\nc\n",
    "ws_lstrip_blocks": "a\n    {% if true %}\n    b\n    {% endif %}\n  c",
    "ws_lstrip_not_mid_line": "x  {% if true %}y{% endif %}  {% if true %}z{% endif %}\n  w",
    "ws_lstrip_not_variables": "  {{ 1 }}\n  {# c #}\n  x",
    "ws_lstrip_unicode_spaces": "a\n\u00a0\t\u3000{% if true %}y{% endif %}",
    "ws_plus_disables": "a\n\t {%+ if true %}\nb{% endif +%}\nc",
    "ws_dash_both": "a {%- if true -%}  \n  b  {%- endif %}\n\nc",
    "ws_dash_unicode": "{% if true -%}\u00a0\u3000\u2028 y{% endif %}",
    "ws_dash_variables": "a  {{- 1 -}}  \n b {{ 2 -}}\n\n c",
    "ws_comment_dashes": "a\n  {#- c #}\nb\n{# d -#}\n\n  e",
    "ws_crlf": "x\r\n{% if true %}\r\ny\r\n{% endif %}\r\nz\r\n",
    "ws_trailing_newline_once": "x\n\n",
    "ws_raw": "{% raw %}\n  {{ x }}\n  {% endraw %}\nz",
    "ws_raw_dashes": "a {%- raw -%}\n  {{ y }}\n  {%- endraw -%}  b",
    "ws_block_after_trim": "{% if true %}\n  {% if true %}\n  in\n  {% endif %}\n{% endif %}\nout",
    "ws_set_lines": "{% set a = 1 %}\n  {% set b = 2 %}\n{{ a + b }}\n",
    "ws_nested_loops": "{% for i in [1, 2] %}\n  {% for j in [3, 4] %}\n    {{ i }}{{ j }}\n  {% endfor %}\n{% endfor %}",
    "scope_loop_set": "{% set x = 0 %}{% for i in [1, 2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}{{ x }}",
    "scope_if_set_leaks": "{% if true %}{% set y = 5 %}{% endif %}{{ y }}",
    "scope_macro_sees_later_set": "{% set y = 5 %}{% macro m() %}{{ y }}{% endmacro %}{% set y = 6 %}{{ m() }}",
    "scope_generation_block": "{% set z = 1 %}{% generation %}{% set z = 2 %}{{ z }}{% endgeneration %}{{ z }}",
    "scope_loop_var_shadow": "{% set i = 'outer' %}{% for i in [1] %}{{ i }}{% endfor %}{{ i }}",
    "loop_nested_outer": "{% for a in [1, 2] %}{% set outer = loop %}{% for b in [3] %}{{ outer.index }}{{ loop.index }} {% endfor %}{% endfor %}",
    "undefined_chain_ok": "[{{ messages }}][{{ none.attr }}][{{ x is defined and x.y }}][{{ {}.a }}]",
    "string_escapes": "{{ 'tab\\there\\nnew \\u00e9 \\x41 \\'q\\' \\\\ \\101' }}",
    "big_loop_output": "{% for i in range(2000) %}{{ i }},{% endfor %}",
    "unicode_slicing": "{{ 'naïve☃😀'[2:5] }} {{ 'naïve☃😀'[::-1] }} {{ 'naïve☃😀'|length }} {{ 'ab😀'[-1] }}",
    "test_precedence": "{{ not 1 is odd }} {{ 1 + 1 is even }} {{ -3|abs }} {{ 'a' ~ 'b'|upper }}",
    "cond_expr_chain": "{{ 'a' if false else 'b' if false else 'c' }} {{ [1, 2] if true }}",
    "dict_items_order": "{% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %} {{ d|tojson }}",
    "dict_number_keys": "{% set gears = {0: 'off', 512: 128, 1.0: 'one', true: 'yes', none: 'n'} %}"
                        "{{ gears }} {{ gears[1] }} {{ gears|tojson }} {% for k, v in {2048: 512, 0: 0, 512.5: 128}|dictsort %}"
                        "{{ k }}={{ v }};{% endfor %} {{ {'b': 1, 'A': 2, 'a': 3}|dictsort }}"
                        " {{ {'b': 1, 'a': 3}|dictsort(by='value', reverse=true) }}",
    "filter_block": "{% set q = 1 %}a{% filter upper | replace('X', '-') %}x{{ q }}{% set q = 2 %}{{ q }}{% endfilter %}{{ q }}\n"
                    "{%- filter trim -%}\n  padded  \n{%- endfilter %}|",
    "select_from_none": "{{ none | selectattr('type', 'equalto', 'x') | list }} {{ none | map(attribute='a') | list }}",
    "safe_is_a_string": "{{ {} | safe | count }} {{ 5 | safe ~ 1 }}",
    "scalar_subscripts_are_undefined": "[{{ (2.5)[::-1] }}][{{ (1)[0] }}][{{ none['k'] }}]",
}
INLINE_CONTEXT = {"dict_items_order": {"d": {"z": 1, "a": 2, "m": 3}}}

# Cases that must fail: (name, source, context, substring of the C++ error).
ERRORS = [
    ("err_raise_exception", "{{ raise_exception('Bad role: ' ~ role) }}", {"role": "bot"},
     "1:4: raise_exception: Bad role: bot"),
    ("err_unknown_filter", "ok\n{{ x | frobnicate }}", {}, "2:8: no filter named 'frobnicate'"),
    ("err_unknown_test", "{% if x is frobbed %}{% endif %}", {"x": 1}, "no test named 'frobbed'"),
    ("err_unknown_tag", "{% include 'x' %}", {}, "1:4: unknown tag 'include'"),
    ("err_unclosed_if", "{% if true %}\nyes", {}, "unexpected end of template, expected 'elif' or 'else' or 'endif'"),
    ("err_mismatched_end", "{% for x in y %}{% endif %}", {"y": []}, "unexpected 'endif', expected 'else' or 'endfor'"),
    ("err_syntax_operator", "{{ 1 + }}", {}, "1:8: unexpected end of print statement '}}', expected an expression"),
    ("err_unclosed_string", "{{ 'abc }}", {}, "1:4: unclosed string literal"),
    ("err_unclosed_comment", "a {# never closed", {}, "1:3: unclosed comment"),
    ("err_break_outside_loop", "{% break %}", {}, "'break' outside a loop"),
    ("err_undefined_attribute", "{{ messages[0].nope.deeper }}", {"messages": [{"role": "user"}]},
     "'dict object' has no attribute 'nope'"),
    ("err_undefined_arithmetic", "{{ missing + 1 }}", {}, "'missing' is undefined"),
    ("err_type_concat", "{{ 'a' + 1 }}", {}, "unsupported operand type(s) for +: 'str' and 'int'"),
    ("err_type_compare", "{{ 1 < 'a' }}", {}, "'<' not supported between instances of 'int' and 'str'"),
    ("err_not_iterable", "{% for x in none %}{% endfor %}", {}, "'NoneType' object is not iterable"),
    ("err_list_append", "{% set xs = [] %}{{ xs.append(1) }}", {}, "access to attribute 'append' of 'list' object is unsafe"),
    ("err_dict_update", "{{ d.update({'a': 1}) }}", {"d": {}}, "access to attribute 'update' of 'dict' object is unsafe"),
    ("err_set_non_namespace", "{% set d.x = 1 %}", {"d": {}}, "cannot assign attribute on non-namespace object"),
    ("err_division_by_zero", "{{ 1 // 0 }}", {}, "division or modulo by zero"),
    ("err_tojson_undefined", "{{ missing | tojson }}", {}, "Object of type Undefined is not JSON serializable"),
    ("err_macro_args", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", {}, "macro 'm' takes not more than 1 argument(s)"),
    ("err_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}, "too many values to unpack (expected 2, got 3)"),
    ("err_range_too_big", "{{ range(100001) | length }}", {}, "range() is too big"),
    ("err_recursion", "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", {}, "nests deeper than max_depth"),
]

# Limits jinja2 does not have (C++ only): (name, source, context, limits, error substring).
LIMITS = [
    ("limit_steps", "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", {},
     {"max_steps": 100000}, "max_steps (100000)"),
    ("limit_output", "{% for i in range(100) %}0123456789{% endfor %}", {}, {"max_output_bytes": 500},
     "max_output_bytes (500)"),
    ("limit_string_doubling", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     {}, {"max_output_bytes": 1 << 20}, "max_output_bytes (1048576)"),
    ("limit_parse_depth", "{{ " + "(" * 40 + "1" + ")" * 40 + " }}", {}, {"max_depth": 20}, "max_depth (20)"),
    ("limit_context_depth", "{{ x }}", {"x": [[[[[[1]]]]]]}, {"max_depth": 4}, "the context nests deeper than max_depth (4)"),
]


def main():
    env = make_env()
    out = []
    for case in CASES:
        out.append(dict(case))
    for name, source in INLINE.items():
        out.append(dict(name=name, source=source, context=INLINE_CONTEXT.get(name, {"x": None})))
    for name, source, context, error in ERRORS:
        out.append(dict(name=name, source=source, context=context, error=error))
    for name, source, context, limits, error in LIMITS:
        out.append(dict(name=name, source=source, context=context, limits=limits, error=error, cpp_only=True))
    for case in out:
        if case.get("cpp_only"):
            continue
        if "template" in case:
            with open(os.path.join(HERE, case["template"]), encoding="utf-8", newline="") as f:
                source = f.read()
        else:
            source = case["source"]
        try:
            rendered = env.from_string(source).render(**case["context"])
        except Exception as e:  # noqa: BLE001 - any jinja2 failure is the expected outcome of an error case
            if "error" not in case:
                raise RuntimeError(f"case {case['name']}: jinja2 failed: {e!r}") from e
            case["jinja2_error"] = f"{type(e).__name__}: {e}"
            continue
        if "error" in case:
            raise RuntimeError(f"case {case['name']}: jinja2 rendered {rendered!r} but an error is expected")
        case["expected"] = rendered
    doc = {
        "comment": "Generated by make_goldens.py with jinja2 " + jinja2.__version__ + "; do not edit.",
        "now_unix_seconds": int(NOW.timestamp()),
        "cases": out,
    }
    with open(os.path.join(HERE, "goldens.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(out)} cases to goldens.json")


if __name__ == "__main__":
    main()
