//! Fuzz chat-template rendering over arbitrary message lists: a real template (ChatML as
//! SmolLM2 and Qwen ship it) with any roles and contents must render or refuse, never panic.
//! The input is split at NUL bytes into role, content, role, content, ...
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run chat_template corpus/chat_template`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xdna::weights::chat::{render_chat_template, ChatMessage};

const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != \
'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + \
'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}\
{% endif %}";

/// A template that refuses some conversations, as many shipped templates do.
const STRICT: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == \
'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate \
user/assistant/user/assistant/...') }}{% endif %}{{ '[' + message['role'] + '] ' + \
message['content'] | trim + eos_token }}{% endfor %}";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let parts: Vec<&str> = text.split('\0').collect();
    let messages: Vec<ChatMessage> = parts
        .chunks(2)
        .map(|pair| ChatMessage::new(pair[0], pair.get(1).copied().unwrap_or("")))
        .collect();
    let rendered = render_chat_template(CHATML, &messages, "<s>", "</s>")
        .expect("ChatML renders every conversation");
    for m in &messages {
        assert!(
            rendered.contains(m.content.as_str()),
            "content kept verbatim"
        );
    }
    let _ = render_chat_template(STRICT, &messages, "<s>", "</s>");
});
