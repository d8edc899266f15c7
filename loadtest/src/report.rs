//! The human-readable side of a `run` report: a Markdown summary and two hand-written SVG
//! plots (latency CDFs; throughput and KV blocks over time). Hand-written because a plotting
//! dependency would cost more build time on the 2-core machines than these few lines.

use std::fmt::Write as _;

use crate::load::Report;
use crate::stats::Summary;

const COLORS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

fn ms(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

pub fn markdown(r: &Report) -> String {
    let s = &r.summary;
    let c = &r.config;
    let mut m = String::new();
    let _ = writeln!(m, "# pdmesh-load: {}\n", r.name);
    let load = match c.rate {
        Some(rate) => format!(
            "open loop, Poisson {rate} req/s{}",
            c.concurrency.map(|k| format!(", at most {k} in flight")).unwrap_or_default()
        ),
        None => format!("closed loop, {} clients", c.concurrency.unwrap_or(8)),
    };
    let input =
        c.input_len.map(|l| format!("{}-{} words", l.min, l.max)).unwrap_or_else(|| "prompt set as written".into());
    let _ = writeln!(
        m,
        "`{}` {:?} endpoint, model `{}`, {load}; input {input}, max_tokens {}-{}, {}, warmup {} ({} failed).\n",
        c.url,
        c.endpoint,
        r.model.as_deref().unwrap_or("(none)"),
        c.output_len.min,
        c.output_len.max,
        if c.no_stream { "non-streaming" } else { "streaming" },
        s.warmup_requests,
        s.warmup_failed,
    );
    let _ = writeln!(m, "| measure | value |\n|---|---|");
    let _ = writeln!(m, "| duration | {:.2} s |", s.duration_s);
    let _ = writeln!(
        m,
        "| requests sent / succeeded / disconnected by the client / failed | {} / {} / {} / {} |",
        s.requests_sent, s.succeeded, s.disconnected, s.failed
    );
    if s.overloaded_503 + s.rate_limited_429 > 0 {
        let _ = writeln!(
            m,
            "| refused: 503 overloaded / 429 rate limited | {} / {} |",
            s.overloaded_503, s.rate_limited_429
        );
    }
    if !s.errors_by_kind.is_empty() {
        let kinds: Vec<String> = s.errors_by_kind.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        let _ = writeln!(m, "| errors by kind | {} |", kinds.join(", "));
    }
    let _ = writeln!(m, "| request throughput | {:.2} req/s |", s.request_throughput_rps);
    let _ = writeln!(m, "| output token throughput | {:.1} tok/s |", s.output_token_throughput_tps);
    let _ = writeln!(
        m,
        "| total token throughput | {:.1} tok/s (prompt tokens from {}) |",
        s.total_token_throughput_tps, s.prompt_tokens_source
    );
    if let Some(g) = &s.goodput {
        let _ = writeln!(
            m,
            "| goodput (TTFT ≤ {} ms, TPOT ≤ {} ms) | {:.2} req/s ({} of {} sent, {:.1} %) |",
            g.slo_ttft_ms.map(ms).unwrap_or_else(|| "∞".into()),
            g.slo_tpot_ms.map(ms).unwrap_or_else(|| "∞".into()),
            g.goodput_rps,
            g.requests_meeting_slo,
            s.requests_sent,
            100.0 * g.fraction_of_sent
        );
    }
    let _ = writeln!(m, "\n| latency (ms) | n | mean | p50 | p90 | p99 |\n|---|---|---|---|---|---|");
    let row = |m: &mut String, name: &str, x: &Summary| {
        let _ = writeln!(
            m,
            "| {name} | {} | {} | {} | {} | {} |",
            x.count,
            ms(x.mean_ms),
            ms(x.p50_ms),
            ms(x.p90_ms),
            ms(x.p99_ms)
        );
    };
    row(&mut m, "TTFT", &s.ttft_ms);
    row(&mut m, "TPOT", &s.tpot_ms);
    row(&mut m, "ITL", &s.itl_ms);
    row(&mut m, "E2E", &s.e2e_ms);
    for sc in &r.scrape {
        let held: Vec<String> = sc
            .series
            .iter()
            .filter(|(k, _)| k.contains("kv_held_blocks") || k.contains("kv_used_blocks"))
            .map(|(k, v)| {
                let max = v.iter().flatten().cloned().fold(f64::NAN, f64::max);
                let last = v.iter().rev().flatten().next().cloned().unwrap_or(f64::NAN);
                format!("`{k}` max {max} last {last}")
            })
            .collect();
        if !held.is_empty() {
            let _ = writeln!(m, "\n{} ({} samples): {}", sc.url, sc.t_s.len(), held.join("; "));
        }
    }
    m
}

/// A plot area inside an SVG, with axis mapping.
struct Panel {
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
    xmin: f64,
    xmax: f64,
    ymin: f64,
    ymax: f64,
    logx: bool,
}

impl Panel {
    fn fx(&self, x: f64) -> f64 {
        let (x, a, b) = if self.logx {
            (x.max(self.xmin).log10(), self.xmin.log10(), self.xmax.log10())
        } else {
            (x, self.xmin, self.xmax)
        };
        self.x0 + self.w * (x - a) / (b - a).max(1e-12)
    }
    fn fy(&self, y: f64) -> f64 {
        self.y0 + self.h - self.h * (y - self.ymin) / (self.ymax - self.ymin).max(1e-12)
    }
    fn frame(&self, svg: &mut String, title: &str, xlabel: &str, ylabel: &str) {
        let _ = writeln!(
            svg,
            r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#444"/>"##,
            self.x0, self.y0, self.w, self.h
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="14" text-anchor="middle">{}</text>"#,
            self.x0 + self.w / 2.0,
            self.y0 - 8.0,
            esc(title)
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
            self.x0 + self.w / 2.0,
            self.y0 + self.h + 34.0,
            esc(xlabel)
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 {:.1} {:.1})">{}</text>"#,
            self.x0 - 46.0,
            self.y0 + self.h / 2.0,
            self.x0 - 46.0,
            self.y0 + self.h / 2.0,
            esc(ylabel)
        );
        // x ticks: decades on a log axis, five steps on a linear one.
        let xticks: Vec<f64> = if self.logx {
            let (a, b) = (self.xmin.log10().floor() as i32, self.xmax.log10().ceil() as i32);
            (a..=b).map(|e| 10f64.powi(e)).filter(|x| *x >= self.xmin * 0.999 && *x <= self.xmax * 1.001).collect()
        } else {
            (0..=5).map(|i| self.xmin + (self.xmax - self.xmin) * i as f64 / 5.0).collect()
        };
        for x in xticks {
            let px = self.fx(x);
            let _ = writeln!(
                svg,
                r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#ddd"/><text x="{px:.1}" y="{:.1}" font-size="10" text-anchor="middle">{}</text>"##,
                self.y0,
                self.y0 + self.h,
                self.y0 + self.h + 14.0,
                tick(x)
            );
        }
        for i in 0..=4 {
            let y = self.ymin + (self.ymax - self.ymin) * i as f64 / 4.0;
            let py = self.fy(y);
            let _ = writeln!(
                svg,
                r##"<line x1="{:.1}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">{}</text>"##,
                self.x0,
                self.x0 + self.w,
                self.x0 - 4.0,
                py + 3.0,
                tick(y)
            );
        }
    }
    fn line(&self, svg: &mut String, pts: &[(f64, f64)], color: &str) {
        if pts.is_empty() {
            return;
        }
        let p: Vec<String> = pts.iter().map(|(x, y)| format!("{:.1},{:.1}", self.fx(*x), self.fy(*y))).collect();
        let _ =
            writeln!(svg, r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#, p.join(" "));
    }
    fn legend(&self, svg: &mut String, items: &[(String, &str)]) {
        for (i, (label, color)) in items.iter().enumerate() {
            let y = self.y0 + 14.0 + 14.0 * i as f64;
            let x = self.x0 + 8.0;
            let _ = writeln!(
                svg,
                r#"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}" font-size="11">{}</text>"#,
                y - 4.0,
                x + 16.0,
                y - 4.0,
                x + 20.0,
                y,
                esc(label)
            );
        }
    }
}

fn tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 || v.abs() < 0.01 {
        format!("{v:.0e}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn svg_open(w: u32, h: u32) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n"
    )
}

/// TTFT, TPOT, ITL and E2E CDFs on one log-scaled millisecond axis (their scales differ by
/// orders of magnitude).
pub fn cdf_svg(r: &Report) -> String {
    let mut svg = svg_open(720, 420);
    let all: Vec<f64> = r.cdf.values().flatten().map(|p| p[0]).filter(|v| *v > 0.0).collect();
    let (lo, hi) = all.iter().fold((f64::INFINITY, 0f64), |(a, b), v| (a.min(*v), b.max(*v)));
    let (lo, hi) = if lo.is_finite() && hi > 0.0 {
        (10f64.powf(lo.log10().floor()), 10f64.powf(hi.log10().ceil().max(lo.log10().floor() + 1.0)))
    } else {
        (0.1, 1000.0)
    };
    let p = Panel { x0: 70.0, y0: 40.0, w: 620.0, h: 320.0, xmin: lo, xmax: hi, ymin: 0.0, ymax: 1.0, logx: true };
    p.frame(&mut svg, &format!("{}: latency CDFs", r.name), "milliseconds (log scale)", "fraction of samples");
    let mut legend = Vec::new();
    for (i, (name, pts)) in r.cdf.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = pts.iter().map(|q| (q[0].max(lo), q[1])).collect();
        p.line(&mut svg, &pts, color);
        legend.push((format!("{} (n={})", name.trim_end_matches("_ms"), pts.len()), color));
    }
    p.legend(&mut svg, &legend);
    svg.push_str("</svg>\n");
    svg
}

/// Output tokens and requests per second (client side) above the KV blocks held and used per
/// scraped service, on one time axis.
pub fn timeline_svg(r: &Report) -> String {
    let mut svg = svg_open(720, 620);
    let tl = &r.timeline;
    let tmax = tl.t_s.len().max(1) as f64;
    let tokmax = tl.output_tokens.iter().cloned().max().unwrap_or(0).max(1) as f64;
    let top = Panel {
        x0: 70.0,
        y0: 40.0,
        w: 620.0,
        h: 220.0,
        xmin: 0.0,
        xmax: tmax,
        ymin: 0.0,
        ymax: tokmax * 1.1,
        logx: false,
    };
    top.frame(&mut svg, &format!("{}: client-side throughput", r.name), "seconds", "per second");
    let toks: Vec<(f64, f64)> = tl.t_s.iter().zip(&tl.output_tokens).map(|(t, v)| (*t + 0.5, *v as f64)).collect();
    top.line(&mut svg, &toks, COLORS[0]);
    // Requests per second on the same axis would be flat next to tokens; scale it into view.
    let reqmax = tl.requests_finished.iter().cloned().max().unwrap_or(0).max(1) as f64;
    let scale = tokmax / reqmax;
    let reqs: Vec<(f64, f64)> =
        tl.t_s.iter().zip(&tl.requests_finished).map(|(t, v)| (*t + 0.5, *v as f64 * scale)).collect();
    top.line(&mut svg, &reqs, COLORS[1]);
    top.legend(
        &mut svg,
        &[("output tokens/s".into(), COLORS[0]), (format!("requests finished/s (× {scale:.1})"), COLORS[1])],
    );

    let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for sc in &r.scrape {
        for (k, v) in &sc.series {
            if !(k.starts_with("pdmesh_engine_kv_held_blocks") || k.starts_with("pdmesh_engine_kv_used_blocks")) {
                continue;
            }
            let pts: Vec<(f64, f64)> = sc.t_s.iter().zip(v).filter_map(|(t, v)| v.map(|v| (*t, v))).collect();
            let short = sc.url.trim_start_matches("http://").trim_end_matches("/metrics");
            lines.push((format!("{short} {}", k.trim_start_matches("pdmesh_engine_kv_")), pts));
        }
    }
    let bmax = lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(1.0, f64::max);
    let tmax2 = lines.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(tmax, f64::max);
    let bottom = Panel {
        x0: 70.0,
        y0: 330.0,
        w: 620.0,
        h: 220.0,
        xmin: 0.0,
        xmax: tmax2,
        ymin: 0.0,
        ymax: bmax * 1.1,
        logx: false,
    };
    bottom.frame(&mut svg, "KV blocks (scraped engine metrics)", "seconds", "blocks");
    let mut legend = Vec::new();
    for (i, (label, pts)) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        bottom.line(&mut svg, pts, color);
        legend.push((label.clone(), color));
    }
    if legend.is_empty() {
        legend.push(("no engine metrics scraped (--scrape)".into(), "#999"));
    }
    bottom.legend(&mut svg, &legend);
    svg.push_str("</svg>\n");
    svg
}
