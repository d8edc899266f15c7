//! Text ⇄ tokens, as the frontend needs it.

use thiserror::Error;

/// One chat message (OpenAI `messages[i]` with text content).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Why text could not be turned into tokens.
#[derive(Debug, Error)]
pub enum TextError {
    /// The chat template failed to render (an HTTP 400 for the caller).
    #[error("chat template error: {0}")]
    Template(String),
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
    /// Encode a prompt (no special tokens added beyond what the text contains).
    fn encode(&self, text: &str) -> Result<Vec<u32>, TextError>;
    /// Decode ids to user-visible text (special tokens skipped).
    fn decode(&self, ids: &[u32]) -> Result<String, TextError>;
    /// A fresh incremental decoder for one output stream.
    fn decode_stream(&self) -> Box<dyn DecodeStream + '_>;
    /// Render chat messages with the model's template, `add_generation_prompt` on.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TextError>;
    /// The text of one token, for logprobs.
    fn token_text(&self, id: u32) -> String;
    fn vocab_size(&self) -> u32;
}
