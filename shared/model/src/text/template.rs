//! The chat template: the GGUF file's `tokenizer.chat_template`, or the file given with
//! `--chat-template` / `model.chat_template`, rendered with minijinja configured like Hugging
//! Face's jinja2 environment: `trim_blocks`, `lstrip_blocks`, Python string methods
//! (pycompat), `raise_exception`, and a `tojson` that writes what Python's `json.dumps` does
//! (`", "` and `": "` separators, `indent=N`, no HTML escaping, keys in their order), so the
//! tool definitions a template prints read as in the model's training data.

use std::io;

use minijinja::value::{Kwargs, Value as JinjaValue};
use minijinja::{Environment, ErrorKind};
use pdmesh_model_api::{ChatMessage, TextError};

use crate::error::ModelError;

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    /// Whether the template reads a `tools` variable (it then renders the tools, and the tool
    /// calls of the history, itself).
    renders_tools: bool,
}

impl ChatTemplate {
    /// Compile `source`; a syntax error is [`ModelError::ChatTemplate`].
    pub(super) fn compile(source: String) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source).map_err(|e| ModelError::ChatTemplate(format!("{e:#}")))?;
        let renders_tools = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?
            .undeclared_variables(false)
            .contains("tools");
        Ok(Self { env, renders_tools })
    }

    pub(super) fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    pub(super) fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, TextError> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(|e| TextError::Template(e.to_string()))?;
        let base = minijinja::context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => true,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        // `tools` is left undefined without tools, as Hugging Face's `apply_chat_template` does
        let ctx = match tools {
            Some(tools) => minijinja::context! { tools => minijinja::value::Serde(tools), ..base },
            None => base,
        };
        tmpl.render(ctx).map_err(|e| TextError::Template(e.to_string()))
    }
}

/// Python's `json.dumps` separators without `indent`: `", "` and `": "`.
struct PyCompact;

impl serde_json::ser::Formatter for PyCompact {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// `value | tojson` / `tojson(indent=N)`, as transformers' chat environment defines it
/// (`json.dumps(value, ensure_ascii=False, indent=indent)`).
fn tojson(value: JinjaValue, kwargs: Kwargs) -> Result<JinjaValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // accepted for compatibility; their defaults are what is written
    let _: Option<JinjaValue> = kwargs.get("ensure_ascii")?;
    let _: Option<JinjaValue> = kwargs.get("sort_keys")?;
    let _: Option<JinjaValue> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json_err = |e: serde_json::Error| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string());
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser =
                serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(&pad));
            serde::Serialize::serialize(&value, &mut ser).map_err(json_err)?;
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PyCompact);
            serde::Serialize::serialize(&value, &mut ser).map_err(json_err)?;
        }
    }
    let text = String::from_utf8(out).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(JinjaValue::from_safe_string(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, tools: Option<&[serde_json::Value]>) -> String {
        let t = ChatTemplate::compile(src.to_string()).unwrap();
        t.render(&[ChatMessage::text("user", "hi <b>")], tools, "<s>", "</s>").unwrap()
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let tools = [serde_json::json!({"type": "function", "function": {"name": "f", "a": [1, 2.5, "é<"], "e": {}}})];
        assert_eq!(
            render("{{ tools[0] | tojson }}", Some(&tools)),
            r#"{"type": "function", "function": {"name": "f", "a": [1, 2.5, "é<"], "e": {}}}"#
        );
        assert_eq!(
            render("{{ tools[0].function.a | tojson(indent=2) }}", Some(&tools)),
            "[\n  1,\n  2.5,\n  \"é<\"\n]"
        );
    }

    #[test]
    fn tools_are_detected_and_undefined_without_tools() {
        let src = "{% if tools %}T{{ tools | length }}{% endif %}{{ messages[0].content }}";
        assert!(ChatTemplate::compile(src.into()).unwrap().renders_tools());
        assert!(!ChatTemplate::compile("{{ messages[0].content }}".into()).unwrap().renders_tools());
        assert_eq!(render(src, None), "hi <b>");
        assert_eq!(render(src, Some(&[serde_json::json!({})])), "T1hi <b>");
        assert!(matches!(ChatTemplate::compile("{% if %}".into()), Err(ModelError::ChatTemplate(_))));
    }
}
