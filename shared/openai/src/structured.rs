//! Structured outputs on the OpenAI API (D53): `response_format` (`json_object`,
//! `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
//! `json_object`) and its older `guided_json` / `guided_regex` / `guided_choice` /
//! `guided_grammar`. They become one [`GuidedSpec`] in the engine's sampling parameters; the
//! spec is compiled here first, so a schema, regex or grammar that cannot be compiled is a 400
//! naming the field and the problem before any engine work.

use pdmesh_protocol::GuidedSpec;
use serde_json::{Map, Value};

use pdmesh_http_edge::error::ApiError;

/// Reads one legacy `guided_*` field's value into a grammar.
type SpecReader = fn(&Value) -> Result<GuidedSpec, ApiError>;

/// The grammar of a request, from whichever field carries it (at most one may).
pub fn guided_spec(extra: &Map<String, Value>) -> Result<Option<(GuidedSpec, &'static str)>, ApiError> {
    let mut found: Vec<(GuidedSpec, &'static str)> = Vec::new();
    if let Some(rf) = extra.get("response_format").filter(|v| !v.is_null()) {
        if let Some(spec) = response_format(rf)? {
            found.push((spec, "response_format"));
        }
    }
    if let Some(so) = extra.get("structured_outputs").filter(|v| !v.is_null()) {
        let obj = so
            .as_object()
            .ok_or_else(|| ApiError::invalid("`structured_outputs` must be an object.", "structured_outputs"))?;
        for (key, value) in obj {
            if value.is_null() || *value == Value::Bool(false) {
                continue;
            }
            let spec = match key.as_str() {
                "json" => json_schema_value(value, "structured_outputs.json")?,
                "regex" => GuidedSpec::Regex(string(value, "structured_outputs.regex")?),
                "choice" => GuidedSpec::Choice(choices(value, "structured_outputs.choice")?),
                "grammar" => GuidedSpec::Lark(string(value, "structured_outputs.grammar")?),
                "json_object" => GuidedSpec::JsonObject,
                // vLLM's backend switches: one backend here (llguidance), nothing to change
                "backend" | "disable_fallback" | "disable_additional_properties" | "disable_any_whitespace" => continue,
                "whitespace_pattern" | "structural_tag" => {
                    return Err(ApiError::invalid(
                        format!("`structured_outputs.{key}` is not supported by this server."),
                        "structured_outputs",
                    ))
                }
                _ => continue,
            };
            found.push((spec, "structured_outputs"));
        }
    }
    let legacy: [(&'static str, SpecReader); 5] = [
        ("guided_json", |v| json_schema_value(v, "guided_json")),
        ("guided_regex", |v| string(v, "guided_regex").map(GuidedSpec::Regex)),
        ("guided_choice", |v| choices(v, "guided_choice").map(GuidedSpec::Choice)),
        ("guided_grammar", |v| string(v, "guided_grammar").map(GuidedSpec::Lark)),
        ("guided_json_object", |_| Ok(GuidedSpec::JsonObject)),
    ];
    for (field, parse) in legacy {
        match extra.get(field) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(v) => found.push((parse(v)?, field)),
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, f)| *f).collect();
        return Err(ApiError::invalid(
            format!("Only one kind of structured output may be set, got {}.", names.join(", ")),
            found.get(1).map_or("response_format", |(_, f)| *f),
        ));
    }
    let Some((spec, field)) = found.pop() else { return Ok(None) };
    pdmesh_guided::validate(&spec).map_err(|e| compile_error(&e, field, &format!("`{field}`")))?;
    Ok(Some((spec, field)))
}

/// The answer to a spec that did not compile (D90): 400 naming the field and the problem or
/// the limit it is over; 503 when every compile thread is busy (the spec may be fine). A
/// compiler failure's detail (a panic's backtrace, with build paths) goes to the log, under
/// the request's span, and never into the body.
pub fn compile_error(e: &pdmesh_guided::GuidedError, param: &str, what: &str) -> ApiError {
    use pdmesh_guided::GuidedError;
    crate::metrics::GUIDED_REFUSALS_TOTAL.with_label_values(&[refusal_reason(e)]).inc();
    match e {
        GuidedError::Busy | GuidedError::Unavailable(_) => {
            tracing::warn!(error = %e.detail(), "structured output not compiled: compiler unavailable");
            ApiError::Overloaded(format!("overloaded: {e}; retry"))
        }
        GuidedError::Compiler(detail) => {
            tracing::warn!(error = %detail, "grammar compiler failed on a request's spec");
            ApiError::invalid(format!("{what} cannot be compiled: {e}."), param)
        }
        GuidedError::Limit(_) => ApiError::invalid(format!("{what} is over a limit: {e}."), param),
        GuidedError::Invalid(_) => ApiError::invalid(format!("{what} cannot be compiled: {e}"), param),
    }
}

/// The `reason` label of `pdmesh_frontend_guided_refusals_total`.
fn refusal_reason(e: &pdmesh_guided::GuidedError) -> &'static str {
    use pdmesh_guided::GuidedError;
    match e {
        GuidedError::Invalid(_) => "invalid",
        GuidedError::Limit(_) => "limit",
        GuidedError::Busy | GuidedError::Unavailable(_) => "busy",
        GuidedError::Compiler(_) => "compiler",
    }
}

/// The `kind` label of a spec in `pdmesh_frontend_structured_output_requests_total`.
pub fn kind(spec: &GuidedSpec) -> &'static str {
    match spec {
        GuidedSpec::JsonSchema(_) => "json_schema",
        GuidedSpec::JsonObject => "json_object",
        GuidedSpec::Regex(_) => "regex",
        GuidedSpec::Choice(_) => "choice",
        GuidedSpec::Lark(_) => "grammar",
    }
}

/// `response_format`: `text` (no grammar), `json_object`, or `json_schema`.
fn response_format(rf: &Value) -> Result<Option<GuidedSpec>, ApiError> {
    let param = "response_format";
    let kind = rf
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid("`response_format.type` must be a string.", param))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(GuidedSpec::JsonObject)),
        "json_schema" => {
            let js = rf.get("json_schema").filter(|v| v.is_object()).ok_or_else(|| {
                ApiError::invalid("`response_format.json_schema` must be an object with a `schema`.", param)
            })?;
            // OpenAI allows a missing schema (any JSON); vLLM's `json_schema.schema`.
            match js.get("schema").filter(|v| !v.is_null()) {
                None => Ok(Some(GuidedSpec::JsonObject)),
                Some(schema) => json_schema_value(schema, param).map(Some),
            }
        }
        other => Err(ApiError::invalid(
            format!("`response_format.type` must be `text`, `json_object` or `json_schema`, got `{other}`."),
            param,
        )),
    }
}

/// A JSON schema given as an object (or boolean) or as JSON text.
fn json_schema_value(v: &Value, param: &'static str) -> Result<GuidedSpec, ApiError> {
    match v {
        Value::String(s) => Ok(GuidedSpec::JsonSchema(s.clone())),
        Value::Object(_) | Value::Bool(_) => Ok(GuidedSpec::JsonSchema(v.to_string())),
        _ => Err(ApiError::invalid(format!("`{param}` must be a JSON schema (an object or a string)."), param)),
    }
}

fn string(v: &Value, param: &'static str) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid(format!("`{param}` must be a string."), param))
}

fn choices(v: &Value, param: &'static str) -> Result<Vec<String>, ApiError> {
    let items =
        v.as_array().ok_or_else(|| ApiError::invalid(format!("`{param}` must be a list of strings."), param))?;
    let list: Option<Vec<String>> = items.iter().map(|c| c.as_str().map(str::to_string)).collect();
    match list {
        Some(l) if !l.is_empty() => Ok(l),
        _ => Err(ApiError::invalid(format!("`{param}` must be a non-empty list of strings."), param)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(body: Value) -> Result<Option<GuidedSpec>, ApiError> {
        let Value::Object(map) = body else { panic!() };
        guided_spec(&map).map(|s| s.map(|(s, _)| s))
    }

    #[test]
    fn every_field_maps_to_one_spec() {
        assert_eq!(spec(json!({})).unwrap(), None);
        assert_eq!(spec(json!({"response_format": {"type": "text"}})).unwrap(), None);
        assert_eq!(spec(json!({"response_format": {"type": "json_object"}})).unwrap(), Some(GuidedSpec::JsonObject));
        let s = spec(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
        );
        assert_eq!(s.unwrap(), Some(GuidedSpec::JsonSchema(r#"{"type":"object"}"#.into())));
        assert_eq!(spec(json!({"guided_regex": "a+"})).unwrap(), Some(GuidedSpec::Regex("a+".into())));
        assert_eq!(
            spec(json!({"guided_choice": ["a", "b"]})).unwrap(),
            Some(GuidedSpec::Choice(vec!["a".into(), "b".into()]))
        );
        assert_eq!(
            spec(json!({"guided_json": "{\"type\":\"integer\"}"})).unwrap(),
            Some(GuidedSpec::JsonSchema("{\"type\":\"integer\"}".into()))
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"regex": "[0-9]+"}})).unwrap(),
            Some(GuidedSpec::Regex("[0-9]+".into()))
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"choice": ["x"], "backend": "guidance"}})).unwrap(),
            Some(GuidedSpec::Choice(vec!["x".into()]))
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"grammar": "start: \"a\""}})).unwrap(),
            Some(GuidedSpec::Lark("start: \"a\"".into()))
        );
    }

    #[test]
    fn bad_specs_are_400s_naming_the_field() {
        let e =
            spec(json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}))
                .unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        assert!(e.to_string().contains("response_format") && e.to_string().contains("objekt"), "{e}");
        assert!(spec(json!({"guided_regex": "(open"})).unwrap_err().to_string().contains("guided_regex"));
        assert!(spec(json!({"guided_choice": []})).is_err());
        assert!(spec(json!({"response_format": {"type": "yaml"}})).is_err());
        assert!(spec(json!({"guided_regex": "a", "guided_choice": ["a"]}))
            .unwrap_err()
            .to_string()
            .contains("Only one"));
        assert!(spec(json!({"structured_outputs": {"whitespace_pattern": " "}})).is_err());
    }
}
