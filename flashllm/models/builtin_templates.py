"""flashllm's built-in chat templates, written from the published prompt formats."""

from __future__ import annotations

# Built-in templates, written from the published prompt formats: (source, bos_token, eos_token).
_CHATML = (
    "{% macro tools_block(tools) %}# Tools\n\nTo call a function, answer with <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call>. Available functions:\n<tools>{% for tool in tools %}{{ '\\n' + tool | tojson }}"
    "{% endfor %}{{ '\\n</tools>' }}{% endmacro %}"
    "{% for message in messages %}"
    "{% if loop.first and message.role != 'system' and tools %}"
    "{{ '<|im_start|>system\\n' + tools_block(tools) + '<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{% if loop.first and message.role == 'system' and tools %}{{ '\\n\\n' + tools_block(tools) }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '\\n<tool_call>\\n' + (call.function or call) | tojson + '\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_LLAMA_2 = (
    "{% if messages[0].role == 'system' %}{% set system, turns = messages[0].content, messages[1:] %}"
    "{% else %}{% set system, turns = none, messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if message.role not in ('user', 'assistant') or (message.role == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('llama-2 conversations alternate user and assistant turns, starting with user, '"
    " 'after an optional system message') }}{% endif %}"
    "{% if message.role == 'user' %}{% set content = message.content | trim %}"
    "{% if loop.first and system is not none %}"
    "{% set content = '<<SYS>>\\n' + system | trim + '\\n<</SYS>>\\n\\n' + content %}{% endif %}"
    "{{ bos_token + '[INST] ' + content + ' [/INST]' }}"
    "{% else %}{{ ' ' + (message.content or '') | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)
_LLAMA_3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) "
    "+ '<|end_header_id|>\\n\\n' + (message.content or '') | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# first-generation Qwen-Chat's ChatML (qwen_generation_utils.make_context): a default system turn
_QWEN = (
    "{% if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatGLM2-6B's prompt (its tokenizer's build_prompt) after the [gMASK]sop prefix: numbered rounds
_CHATGLM2 = (
    "{{ '[gMASK]sop' }}{% for message in messages %}"
    "{% if message.role not in ('user', 'assistant') or (message.role == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('chatglm2 conversations alternate user and assistant turns, starting with user '"
    " '(it has no system or tool role)') }}{% endif %}"
    "{% if message.role == 'user' %}"
    "{{ '[Round ' ~ (loop.index0 // 2 + 1) ~ ']\\n\\n问：' + message.content + '\\n\\n答：' }}"
    "{% else %}{{ (message.content or '') + '\\n\\n' }}{% endif %}{% endfor %}"
)
# ChatGLM3-6B's chat template (tool role as <|observation|>; tools as JSON after the system text, as
# its build_chat_input does, under its tool-use system prompt when the conversation has none)
_CHATGLM3 = (
    "{{ '[gMASK]sop' }}{% if tools and messages[0].role != 'system' %}"
    "{{ '<|system|>\\n Answer the following questions as best as you can. You have access to the following tools:'"
    " + '\\n' + tools | tojson(indent=4) }}{% endif %}{% for message in messages %}"
    "{{ '<|' + ('observation' if message.role == 'tool' else message.role) + '|>\\n ' + (message.content or '') }}"
    "{% if loop.first and message.role == 'system' and tools %}{{ '\\n' + tools | tojson(indent=4) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Baichuan2-Chat (its generation_utils.build_chat_input): an optional leading system text, then each user
# turn after <reserved_106> (id 195) and each assistant turn after <reserved_107> (id 196); no BOS
_BAICHUAN_2 = (
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{% if not loop.first %}"
    "{{ raise_exception('baichuan-2 takes a system message only as the first message') }}{% endif %}"
    "{{ message.content or '' }}"
    "{% elif message.role == 'user' %}{{ '<reserved_106>' + (message.content or '') }}"
    "{% elif message.role == 'assistant' %}{{ '<reserved_107>' + (message.content or '') }}"
    "{% else %}{{ raise_exception('baichuan-2 conversations have system, user and assistant messages only') }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt and messages[-1].role != 'assistant' %}{{ '<reserved_107>' }}{% endif %}"
)
# GLM-4-Chat (its tokenizer's build_chat_input): [gMASK]<sop>, then each message after its role token and a
# newline, <|assistant|> to prompt the answer; tools are the checkpoint's own template's business
_GLM_4 = (
    "{% if tools %}{{ raise_exception('the built-in glm-4 template does not render tools; use the checkpoint\\'s '"
    " 'own chat template') }}{% endif %}{{ '[gMASK]<sop>' }}{% for message in messages %}"
    "{{ '<|' + ('observation' if message.role == 'tool' else message.role) + '|>\\n' + (message.content or '') }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
BUILTIN_TEMPLATES: dict[str, tuple[str, str, str]] = {
    "chatml": (_CHATML, "", "<|im_end|>"),
    "qwen": (_QWEN, "", "<|im_end|>"),
    "llama-2": (_LLAMA_2, "<s>", "</s>"),
    "llama-3": (_LLAMA_3, "<|begin_of_text|>", "<|eot_id|>"),
    "baichuan-2": (_BAICHUAN_2, "", "</s>"),
    "chatglm2": (_CHATGLM2, "", "</s>"),
    "chatglm3": (_CHATGLM3, "", "</s>"),
    "glm-4": (_GLM_4, "", "<|endoftext|>"),
}
