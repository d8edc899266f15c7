//! Tool calling in chat (D54): `tools`, `tool_choice`, tool calls in the history, and
//! `tool_calls` in the answer.
//!
//! The model's chat template is used as is. When it renders tools itself (it reads a `tools`
//! variable: Qwen2.5's ChatML-with-tools, Llama 3's) it gets `tools` and the history's
//! `tool_calls` / `tool` messages as data, as Hugging Face's `apply_chat_template` gives them
//! (D88); Qwen's asks for the same Hermes `<tool_call>` answers read here. When it has no tool
//! support (SmolLM2's has none) the tools go into a Hermes-style system block, and calls are
//! written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what vLLM's `hermes`
//! parser reads). `tool_choice`:
//! - `none`: the tools are not shown and nothing is parsed;
//! - `auto` (the default with tools): the answer is searched for `<tool_call>` blocks;
//! - `required` / a named function: the structured-output machinery (D53) forces a valid call,
//!   as vLLM does: a JSON array of `{"name", "parameters"}` for `required`, the arguments object
//!   itself for a named function.

use pdmesh_protocol::GuidedSpec;
use serde_json::{json, Value};

use pdmesh_http_edge::error::ApiError;

/// `limits.max_tools` of this process (D91), set once at start.
static MAX_TOOLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(128);

/// Set `limits.max_tools` (the frontend does, at start).
pub fn set_max_tools(n: u32) {
    MAX_TOOLS.store(n, std::sync::atomic::Ordering::Relaxed);
}

/// Entries a request's `tools` may hold.
pub fn max_tools() -> usize {
    MAX_TOOLS.load(std::sync::atomic::Ordering::Relaxed) as usize
}

/// How the answer of a request with tools is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    Auto,
    Required,
    Named(String),
}

/// What a request's `tools` and `tool_choice` turn into.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSetup {
    pub mode: ToolMode,
    /// The system block describing the tools (prepended to the system message).
    pub system_block: String,
    /// The grammar that forces a call (`required` and named).
    pub guided: Option<GuidedSpec>,
}

/// One parsed call of the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments, as JSON text (OpenAI sends a string).
    pub arguments: String,
}

struct Tool {
    name: String,
    parameters: Value,
    definition: Value,
}

fn tools_list(tools: &[Value]) -> Result<Vec<Tool>, ApiError> {
    // counted before any is read (D91)
    let max = max_tools();
    if tools.len() > max {
        return Err(ApiError::invalid(
            format!("`tools` may hold at most {max} tools (`limits.max_tools`), got {}.", tools.len()),
            "tools",
        ));
    }
    tools
        .iter()
        .map(|t| {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid("`tools`: every tool must be `{\"type\": \"function\", ...}`.", "tools"));
            }
            let f = t
                .get("function")
                .filter(|f| f.is_object())
                .ok_or_else(|| ApiError::invalid("`tools`: every tool must have a `function` object.", "tools"))?;
            let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).ok_or_else(|| {
                ApiError::invalid("`tools`: every tool function must have a non-empty `name`.", "tools")
            })?;
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p) if p.is_object() => p.clone(),
                Some(_) => {
                    return Err(ApiError::invalid(format!("`parameters` of tool `{name}` must be an object."), "tools"))
                }
            };
            Ok(Tool { name: name.to_string(), parameters, definition: f.clone() })
        })
        .collect()
}

/// Hermes-style instructions (NousResearch Hermes 2 Pro's template, which vLLM's `hermes`
/// parser reads back).
fn system_block(tools: &[Tool]) -> String {
    let defs: Vec<String> =
        tools.iter().map(|t| json!({"type": "function", "function": t.definition}).to_string()).collect();
    format!(
        "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML \
         tags. You may call one or more functions to assist with the user query. Don't make assumptions about what \
         values to plug into functions. Here are the available tools: <tools>\n{}\n</tools>\nFor each function call \
         return a json object with function name and arguments within <tool_call></tool_call> XML tags as follows:\n\
         <tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>",
        defs.join("\n")
    )
}

/// `tools` + `tool_choice` → how to prompt and read the answer; `None` when no tool is in play.
pub fn tool_setup(tools: Option<&[Value]>, tool_choice: Option<&Value>) -> Result<Option<ToolSetup>, ApiError> {
    let tools = tools_list(tools.unwrap_or(&[]))?;
    let choice = match tool_choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match s.as_str() {
            "none" | "auto" | "required" => Some(s.clone()),
            other => {
                return Err(ApiError::invalid(
                    format!("`tool_choice` must be `none`, `auto`, `required` or a named function, got `{other}`."),
                    "tool_choice",
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "a named `tool_choice` must be `{\"type\": \"function\", \"function\": {\"name\": ...}}`.",
                        "tool_choice",
                    )
                })?;
            Some(format!("function:{name}"))
        }
    };
    if tools.is_empty() {
        return match choice.as_deref() {
            None | Some("none") | Some("auto") => Ok(None),
            Some(_) => Err(ApiError::invalid("`tool_choice` needs `tools`.", "tool_choice")),
        };
    }
    let (mode, guided) = match choice.as_deref() {
        Some("none") => return Ok(None),
        None | Some("auto") => (ToolMode::Auto, None),
        Some("required") => {
            let alternatives: Vec<Value> = tools
                .iter()
                .map(|t| {
                    json!({"type": "object",
                           "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.parameters},
                           "required": ["name", "parameters"], "additionalProperties": false})
                })
                .collect();
            let schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": alternatives}});
            (ToolMode::Required, Some(GuidedSpec::JsonSchema(schema.to_string())))
        }
        Some(named) => {
            let name = named.strip_prefix("function:").unwrap_or(named);
            let tool = tools.iter().find(|t| t.name == name).ok_or_else(|| {
                ApiError::invalid(format!("`tool_choice` names `{name}`, which is not in `tools`."), "tool_choice")
            })?;
            (ToolMode::Named(name.to_string()), Some(GuidedSpec::JsonSchema(tool.parameters.to_string())))
        }
    };
    if let Some(spec) = &guided {
        pdmesh_guided::validate(spec)
            .map_err(|e| crate::structured::compile_error(&e, "tools", "the tool's `parameters`"))?;
    }
    Ok(Some(ToolSetup { mode, system_block: system_block(&tools), guided }))
}

/// The text of an assistant message's `tool_calls` in the history, as the model writes calls.
pub fn render_tool_calls(calls: &[Value]) -> Result<String, ApiError> {
    let mut out = Vec::new();
    for c in calls {
        let f =
            c.get("function").ok_or_else(|| ApiError::invalid("a tool call must have a `function`.", "messages"))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        // `arguments` is JSON text in OpenAI's shape; keep it as JSON when it parses
        let arguments = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::String(s.clone())),
            Some(v) => v.clone(),
            None => json!({}),
        };
        out.push(format!("<tool_call>\n{}\n</tool_call>", json!({"name": name, "arguments": arguments})));
    }
    Ok(out.join("\n"))
}

/// An assistant message's `tool_calls` as a template that renders tools reads them: each call
/// as sent, with `function.arguments` (JSON text in OpenAI's shape) parsed to the object the
/// template prints with `tojson` (vLLM does the same); text that is not JSON is kept as text.
pub fn template_tool_calls(calls: &[Value]) -> Result<Vec<Value>, ApiError> {
    calls
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let f = c
                .get_mut("function")
                .filter(|f| f.is_object())
                .ok_or_else(|| ApiError::invalid("a tool call must have a `function` object.", "messages"))?;
            if let Some(Value::String(text)) = f.get("arguments") {
                if let Ok(parsed) = serde_json::from_str::<Value>(text) {
                    f["arguments"] = parsed;
                }
            }
            Ok(c)
        })
        .collect()
}

/// A `role: "tool"` message's content, as Hermes templates show a tool's result.
pub fn render_tool_result(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// Read the calls out of a finished answer: `(content left, calls)`, or `None` when the text
/// holds no call (it is then an ordinary answer).
pub fn parse(mode: &ToolMode, text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    match mode {
        ToolMode::Named(name) => {
            let v: Value = serde_json::from_str(text.trim()).ok()?;
            Some((None, vec![ToolCall { name: name.clone(), arguments: v.to_string() }]))
        }
        ToolMode::Required => {
            let v: Value = serde_json::from_str(text.trim()).ok()?;
            let calls: Vec<ToolCall> = v
                .as_array()?
                .iter()
                .filter_map(|c| {
                    Some(ToolCall {
                        name: c.get("name")?.as_str()?.to_string(),
                        arguments: c.get("parameters").cloned().unwrap_or_else(|| json!({})).to_string(),
                    })
                })
                .collect();
            (!calls.is_empty()).then_some((None, calls))
        }
        ToolMode::Auto => {
            let start = text.find("<tool_call>")?;
            let mut calls = Vec::new();
            let mut rest = &text[start..];
            while let Some(open) = rest.find("<tool_call>") {
                let after = &rest[open + "<tool_call>".len()..];
                let (body, next) = match after.find("</tool_call>") {
                    Some(close) => (&after[..close], &after[close + "</tool_call>".len()..]),
                    None => (after, ""),
                };
                let v: Value = serde_json::from_str(body.trim()).ok()?;
                let name = v.get("name")?.as_str()?.to_string();
                let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or_else(|| json!({}));
                calls.push(ToolCall { name, arguments: args.to_string() });
                rest = next;
            }
            let content = text[..start].trim();
            Some(((!content.is_empty()).then(|| content.to_string()), calls))
        }
    }
}

/// The calls of a forced answer (`required` or a named function) that the token limit cut:
/// every call that is complete, then the cut one with what was produced of its arguments (raw,
/// not valid JSON), so nothing generated is lost and nothing is passed off as plain content.
/// vLLM returns a named call's text as its `arguments` whatever the finish; the response's
/// `finish_reason` (`length`) is what marks the last call incomplete.
pub fn parse_cut(mode: &ToolMode, text: &str) -> Vec<ToolCall> {
    let text = text.trim();
    match mode {
        ToolMode::Named(name) => {
            let arguments = serde_json::from_str::<Value>(text).map_or_else(|_| text.to_string(), |v| v.to_string());
            vec![ToolCall { name: name.clone(), arguments }]
        }
        ToolMode::Required => {
            let mut calls = Vec::new();
            let mut rest = text.strip_prefix('[').unwrap_or(text);
            loop {
                rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
                if rest.is_empty() || rest.starts_with(']') {
                    break;
                }
                let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                match values.next() {
                    Some(Ok(v)) => {
                        if let Some(name) = v.get("name").and_then(Value::as_str) {
                            let arguments = v.get("parameters").cloned().unwrap_or_else(|| json!({})).to_string();
                            calls.push(ToolCall { name: name.to_string(), arguments });
                        }
                        rest = &rest[values.byte_offset()..];
                    }
                    _ => {
                        calls.extend(cut_call(rest));
                        break;
                    }
                }
            }
            calls
        }
        ToolMode::Auto => Vec::new(),
    }
}

/// The name and raw arguments of a call object cut short (`{"name": "f", "parameters": {"x`),
/// if its name was produced in full (the grammar writes `name` before `parameters`).
fn cut_call(object: &str) -> Option<ToolCall> {
    let after_key = &object[object.find("\"name\"")? + "\"name\"".len()..];
    let value = after_key.trim_start().strip_prefix(':')?.trim_start();
    let name = serde_json::Deserializer::from_str(value).into_iter::<String>().next()?.ok()?;
    let arguments = match object.find("\"parameters\"") {
        Some(at) => {
            let v = object[at + "\"parameters\"".len()..].trim_start();
            v.strip_prefix(':').unwrap_or(v).trim_start().to_string()
        }
        None => String::new(),
    };
    Some(ToolCall { name, arguments })
}

/// The OpenAI shape of the calls (`message.tool_calls`, and with `index` in stream deltas).
pub fn calls_json(calls: &[ToolCall], id_seed: &str, with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": format!("chatcmpl-tool-{id_seed}-{i}"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if with_index {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]
    }

    #[test]
    fn tool_choice_picks_the_mode_and_the_grammar() {
        let t = weather();
        let t = t.as_slice();
        assert_eq!(tool_setup(None, None).unwrap(), None);
        assert_eq!(tool_setup(None, Some(&json!("auto"))).unwrap(), None);
        assert!(tool_setup(None, Some(&json!("required"))).is_err());
        assert_eq!(tool_setup(Some(t), Some(&json!("none"))).unwrap(), None);
        let auto = tool_setup(Some(t), None).unwrap().unwrap();
        assert_eq!(auto.mode, ToolMode::Auto);
        assert!(auto.guided.is_none() && auto.system_block.contains("get_weather"));
        let req = tool_setup(Some(t), Some(&json!("required"))).unwrap().unwrap();
        assert!(matches!(req.guided, Some(GuidedSpec::JsonSchema(_))));
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let n = tool_setup(Some(t), Some(&named)).unwrap().unwrap();
        assert_eq!(n.mode, ToolMode::Named("get_weather".into()));
        let missing = json!({"type": "function", "function": {"name": "nope"}});
        assert!(tool_setup(Some(t), Some(&missing)).unwrap_err().to_string().contains("nope"));
        assert!(tool_setup(Some(&[json!({"type": "retrieval"})][..]), None).is_err());
    }

    #[test]
    fn calls_are_parsed_in_every_mode() {
        let (c, calls) = parse(&ToolMode::Named("f".into()), "{\"a\": 1}").unwrap();
        assert!(c.is_none());
        assert_eq!(calls, vec![ToolCall { name: "f".into(), arguments: "{\"a\":1}".into() }]);
        let (_, calls) = parse(&ToolMode::Required, r#"[{"name": "f", "parameters": {"x": "y"}}]"#).unwrap();
        assert_eq!(calls[0].name, "f");
        let text = "Let me check.\n<tool_call>\n{\"name\": \"g\", \"arguments\": {\"q\": 2}}\n</tool_call>";
        let (content, calls) = parse(&ToolMode::Auto, text).unwrap();
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls, vec![ToolCall { name: "g".into(), arguments: "{\"q\":2}".into() }]);
        assert!(parse(&ToolMode::Auto, "no calls here").is_none());
        assert!(parse(&ToolMode::Named("f".into()), "{truncated").is_none());
        // cut by the token limit: complete calls parsed, the cut one kept raw
        assert_eq!(
            parse_cut(&ToolMode::Named("f".into()), "{\"city\": \"Par"),
            vec![ToolCall { name: "f".into(), arguments: "{\"city\": \"Par".into() }]
        );
        let cut = r#"[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {"y": "ab"#;
        assert_eq!(
            parse_cut(&ToolMode::Required, cut),
            vec![
                ToolCall { name: "f".into(), arguments: "{\"x\":1}".into() },
                ToolCall { name: "g".into(), arguments: "{\"y\": \"ab".into() },
            ]
        );
        assert_eq!(parse_cut(&ToolMode::Required, r#"[{"name": "f", "parameters": {"x": 1}}, {"na"#).len(), 1);
        assert!(parse_cut(&ToolMode::Required, "[").is_empty());
        let history = render_tool_calls(&[json!({"id": "1", "type": "function",
            "function": {"name": "g", "arguments": "{\"q\": 2}"}})])
        .unwrap();
        assert_eq!(history, format!("<tool_call>\n{}\n</tool_call>", json!({"name": "g", "arguments": {"q": 2}})));
    }

    #[test]
    fn template_calls_carry_parsed_arguments() {
        let calls = [
            json!({"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{\"q\": 2}"}}),
            json!({"type": "function", "function": {"name": "h", "arguments": "not json"}}),
        ];
        let out = template_tool_calls(&calls).unwrap();
        assert_eq!(out[0], json!({"id": "c1", "type": "function", "function": {"name": "g", "arguments": {"q": 2}}}));
        assert_eq!(out[1]["function"]["arguments"], json!("not json"));
        assert!(template_tool_calls(&[json!({"id": "x"})]).is_err());
    }
}
