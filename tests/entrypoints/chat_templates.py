"""Chat templates for tests, written here in the style of GLM-4.5/4.7/5.x's own (not copied):
tools as JSON lines rendered with ``tojson(ensure_ascii=False)``, an assistant's calls as
``<tool_call>`` blocks with ``<arg_key>``/``<arg_value>`` pairs, tool results after
``<|observation|>``, the thinking block opened by the generation prompt (closed at once with
``enable_thinking: false``), ``namespace``, ``{% break %}`` and ``raise_exception``."""

GLM_STYLE_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Functions
You may call the functions below. Each is one JSON object:
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
Call one as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>.
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages | reverse -%}
{%- if m.role == 'user' -%}
{%- set ns.last_user = messages | length - 1 - loop.index0 -%}
{%- break -%}
{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role in ('system', 'developer') -%}
<|system|>
{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if loop.index0 > ns.last_user and m.reasoning_content -%}
<think>{{ m.reasoning_content.strip() }}</think>
{%- else -%}
</think>
{%- endif -%}
{%- if m.content %}
{{ m.content.strip() }}
{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
<tool_call>{{ fn.name }}
{%- for k, v in fn.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
<|observation|>
{%- endif -%}
<tool_response>{{ m.content }}</tool_response>
{%- else -%}
{{ raise_exception('unknown role ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{%- if enable_thinking is defined and not enable_thinking -%}
</think>
{%- else -%}
<think>
{%- endif -%}
{%- endif -%}"""
