//! Text ⇄ tokens, as the frontend needs it.

use thiserror::Error;

/// One chat message (OpenAI `messages[i]` with text content).
///
/// `tool_calls`, `tool_call_id` and `name` are set only for a template that renders tool
/// calling itself ([`TextCodec::template_renders_tools`]): the assistant's calls (OpenAI's
/// `{"id", "type": "function", "function": {"name", "arguments"}}`, with `arguments` as a JSON
/// object, the shape Hugging Face templates read) and a tool result's call id. Absent fields
/// are left out of the template's context, so `message.tool_calls is defined` is false.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A plain text message.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), ..Self::default() }
    }
}

/// Why text could not be turned into tokens.
#[derive(Debug, Error)]
pub enum TextError {
    /// The chat template failed to render (an HTTP 400 for the caller).
    #[error("chat template error: {0}")]
    Template(String),
    /// The model has no chat template and none was configured: chat cannot be rendered (an
    /// HTTP 400 naming the fix, as vLLM answers).
    #[error(
        "the model has no chat template; start it with --chat-template FILE (or set model.chat_template in the \
         topology), or use /v1/completions"
    )]
    NoChatTemplate,
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
}

/// Incremental detokenisation for streaming: feed token ids one by one, get text chunks that
/// never split a UTF-8 character.
pub trait DecodeStream: Send {
    /// Text made complete by this token (possibly empty).
    fn step(&mut self, token_id: u32) -> Result<String, TextError>;
}

/// Tokenizer plus chat template of a model.
pub trait TextCodec: Send + Sync {
    /// Encode text as it is: no special token is added (special tokens written in the text,
    /// like `<|im_start|>`, still become their single ids).
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError>;
    /// Encode a whole prompt (a completions `prompt`, or rendered chat text): as
    /// [`encode`](Self::encode), plus the special tokens the model asks to begin a sequence
    /// with (BOS when the file sets `add_bos_token`, as Hugging Face's
    /// `add_special_tokens=True`) unless the text already begins with them (a chat template
    /// that writes `{{ bos_token }}`), so a prompt never starts with two BOS.
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.encode(text)
    }
    /// Decode ids to user-visible text (special tokens skipped).
    fn decode(&self, ids: &[u32]) -> Result<String, TextError>;
    /// A fresh incremental decoder for one output stream.
    fn decode_stream(&self) -> Box<dyn DecodeStream + '_>;
    /// Render chat messages with the model's template, `add_generation_prompt` on, no tools.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TextError> {
        self.render_chat_with_tools(messages, None)
    }
    /// [`render_chat`](Self::render_chat) with `tools` (OpenAI's `tools` array) given to the
    /// template as its `tools` variable; callers pass tools only when
    /// [`template_renders_tools`](Self::template_renders_tools).
    fn render_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, TextError>;
    /// Whether the chat template renders `tools` (and tool calls in the history) itself, as
    /// Qwen's and Llama 3's do; `false` (the default) when the caller must describe the tools
    /// in a system message and flatten tool calls into text.
    fn template_renders_tools(&self) -> bool {
        false
    }
    /// The text of one token, for logprobs.
    fn token_text(&self, id: u32) -> String;
    fn vocab_size(&self) -> u32;
}
