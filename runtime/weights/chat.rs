//! Chat prompts: a package's Jinja chat template rendered over a conversation. The one place a
//! list of messages becomes prompt text (`xdna run --chat` and forward-serve's chat route).

use super::{Package, WeightsError};

/// One chat message, already flattened to text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

impl Package {
    /// The prompt text of `messages` followed by the assistant's turn: the package's chat
    /// template rendered by [`render_chat_template`] with the package's BOS and EOS tokens. A
    /// package without a template, a template that does not parse, and a conversation the
    /// template refuses are errors naming the package.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, WeightsError> {
        let error = |what: String| WeightsError::ChatTemplate {
            path: self.dir().to_path_buf(),
            what,
        };
        let template = self.chat_template().ok_or_else(|| {
            error(
                "the package has no chat template (neither chat_template.jinja nor \
                 tokenizer_config.json's chat_template)"
                    .into(),
            )
        })?;
        let tokenizer = self.tokenizer();
        let token_text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.token_str(i))
                .unwrap_or("")
                .to_string()
        };
        render_chat_template(
            template,
            messages,
            &token_text(self.bos_token_id()),
            &token_text(self.eos_token_ids().first().copied()),
        )
        .map_err(error)
    }
}

/// `template` rendered over `messages` followed by the assistant's turn, as Hugging Face's
/// `apply_chat_template(..., add_generation_prompt=True)` renders it: `messages` (each with
/// `role` and `content`), `add_generation_prompt`, `bos_token`, `eos_token` and
/// `raise_exception` in scope. The error is the template engine's message, or the template's own
/// refusal.
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    bos_token: &str,
    eos_token: &str,
) -> Result<String, String> {
    let mut env = minijinja::Environment::new();
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    let render_error = |e: minijinja::Error| e.to_string();
    env.add_template("chat", template).map_err(render_error)?;
    let messages: Vec<minijinja::Value> = messages
        .iter()
        .map(|m| minijinja::context! { role => m.role.clone(), content => m.content.clone() })
        .collect();
    env.get_template("chat")
        .map_err(render_error)?
        .render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => bos_token,
            eos_token => eos_token,
        })
        .map_err(render_error)
}
