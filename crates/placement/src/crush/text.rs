//! crushtool's text map syntax (what `crushtool -d` prints), compiled with the same
//! defaults and id assignment as `crushtool -c`.

use super::builder::{BucketSpec, MapBuilder};
use super::{CrushError, CrushMap, Mode, Rule, Step, Tunables, WEIGHT_ONE};
use std::collections::{BTreeMap, BTreeSet};

/// Compiles a text map.
pub fn parse(text: &str) -> Result<CrushMap, CrushError> {
    let tokens: Vec<Token> = tokenize(text);
    let mut parser = Parser {
        tokens: &tokens,
        next: 0,
        builder: MapBuilder::new(Tunables::default()),
        ids: BTreeMap::new(),
        item_weights: BTreeMap::new(),
        used_bucket_ids: used_bucket_ids(&tokens),
    };
    parser.map()?;
    Ok(parser.builder.build())
}

struct Token<'a> {
    text: &'a str,
    line: usize,
}

fn tokenize(text: &str) -> Vec<Token<'_>> {
    let mut tokens = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let code = line.split('#').next().unwrap_or("");
        for word in code.split_whitespace() {
            // Braces may touch their neighbours ("host a{").
            let mut rest = word;
            while !rest.is_empty() {
                let cut = rest.find(['{', '}', '[', ']']).unwrap_or(rest.len());
                let (head, tail) = if cut == 0 {
                    rest.split_at(1)
                } else {
                    rest.split_at(cut)
                };
                tokens.push(Token {
                    text: head,
                    line: index + 1,
                });
                rest = tail;
            }
        }
    }
    tokens
}

/// The ids written in bucket `id` lines, class ones included: crushtool keeps them out
/// of the ids it assigns to buckets written without one.
fn used_bucket_ids(tokens: &[Token]) -> BTreeSet<i32> {
    tokens
        .windows(2)
        .filter(|w| w[0].text == "id")
        .filter_map(|w| w[1].text.parse().ok())
        .filter(|id: &i32| *id < 0)
        .collect()
}

struct Parser<'a> {
    tokens: &'a [Token<'a>],
    next: usize,
    builder: MapBuilder,
    /// Device and bucket names -> ids.
    ids: BTreeMap<String, i32>,
    /// A bucket's total weight: the default weight of an `item` naming it.
    item_weights: BTreeMap<i32, u32>,
    used_bucket_ids: BTreeSet<i32>,
}

impl<'a> Parser<'a> {
    fn error(&self, message: impl std::fmt::Display) -> CrushError {
        let line = self
            .tokens
            .get(self.next.saturating_sub(1))
            .map_or(0, |t| t.line);
        CrushError::new(format!("line {line}: {message}"))
    }

    fn peek(&self) -> Option<&'a str> {
        self.tokens.get(self.next).map(|t| t.text)
    }

    fn word(&mut self) -> Result<&'a str, CrushError> {
        let token = self
            .tokens
            .get(self.next)
            .ok_or_else(|| self.error("unexpected end of map"))?;
        self.next += 1;
        Ok(token.text)
    }

    fn expect(&mut self, want: &str) -> Result<(), CrushError> {
        let got = self.word()?;
        if got != want {
            return Err(self.error(format!("expected '{want}', found '{got}'")));
        }
        Ok(())
    }

    fn number<T: std::str::FromStr>(&mut self) -> Result<T, CrushError> {
        let word = self.word()?;
        word.parse()
            .map_err(|_| self.error(format!("expected a number, found '{word}'")))
    }

    /// A weight as crushtool reads it: a float, times 0x10000 in float arithmetic,
    /// truncated.
    fn weight(&mut self) -> Result<u32, CrushError> {
        let value: f32 = self.number()?;
        Ok((value * WEIGHT_ONE as f32) as u32)
    }

    fn eat(&mut self, keyword: &str) -> bool {
        let found = self.peek() == Some(keyword);
        if found {
            self.next += 1;
        }
        found
    }

    fn map(&mut self) -> Result<(), CrushError> {
        let mut saw_rule = false;
        while let Some(word) = self.peek() {
            self.next += 1;
            match word {
                "tunable" => self.tunable()?,
                "device" => self.device()?,
                "type" => {
                    let id = self.number()?;
                    let name = self.word()?;
                    self.builder.add_type(id, name);
                }
                "rule" => {
                    saw_rule = true;
                    self.rule()?;
                }
                "choose_args" => {
                    return Err(self.error("choose_args (weight sets) are not supported"))
                }
                bucket_type => {
                    if saw_rule {
                        return Err(self.error("buckets must be defined before rules"));
                    }
                    self.bucket(bucket_type)?;
                }
            }
        }
        Ok(())
    }

    fn tunable(&mut self) -> Result<(), CrushError> {
        let name = self.word()?;
        let value: u32 = self.number()?;
        let t = self.builder.tunables_mut();
        let field = match name {
            "choose_local_tries" => &mut t.choose_local_tries,
            "choose_local_fallback_tries" => &mut t.choose_local_fallback_tries,
            "choose_total_tries" => &mut t.choose_total_tries,
            "chooseleaf_descend_once" => &mut t.chooseleaf_descend_once,
            "chooseleaf_vary_r" => &mut t.chooseleaf_vary_r,
            "chooseleaf_stable" => &mut t.chooseleaf_stable,
            "straw_calc_version" => &mut t.straw_calc_version,
            "allowed_bucket_algs" => &mut t.allowed_bucket_algs,
            other => return Err(self.error(format!("tunable {other} not recognized"))),
        };
        *field = value;
        Ok(())
    }

    fn device(&mut self) -> Result<(), CrushError> {
        let id: i32 = self.number()?;
        let name = self.word()?;
        if id < 0 {
            return Err(self.error(format!("device {name} has negative id {id}")));
        }
        let class = if self.eat("class") {
            Some(self.word()?)
        } else {
            None
        };
        if self.ids.insert(name.to_string(), id).is_some() {
            return Err(self.error(format!("item {name} defined twice")));
        }
        self.builder.add_device(id, name, class);
        Ok(())
    }

    fn bucket(&mut self, type_name: &str) -> Result<(), CrushError> {
        let type_id = self
            .builder
            .type_id(type_name)
            .ok_or_else(|| self.error(format!("bucket type '{type_name}' is not defined")))?;
        let name = self.word()?;
        if self.ids.contains_key(name) {
            return Err(self.error(format!("bucket or device '{name}' is already defined")));
        }
        self.expect("{")?;
        let mut id = None;
        let mut shadow_ids = Vec::new();
        let mut items = Vec::new();
        loop {
            match self.word()? {
                "}" => break,
                "id" => {
                    let value: i32 = self.number()?;
                    if self.eat("class") {
                        shadow_ids.push((self.word()?, value));
                    } else {
                        id = Some(value);
                    }
                }
                "alg" => {
                    let alg = self.word()?;
                    if alg != "straw2" {
                        return Err(self.error(format!(
                            "bucket {name}: alg {alg} is not supported, only straw2"
                        )));
                    }
                }
                "hash" => {
                    let hash = self.word()?;
                    if hash != "0" && hash != "rjenkins1" {
                        return Err(self.error(format!(
                            "bucket {name}: hash {hash} is not supported, only 0 (rjenkins1)"
                        )));
                    }
                }
                "item" => {
                    let item_name = self.word()?;
                    let item = *self.ids.get(item_name).ok_or_else(|| {
                        self.error(format!(
                            "item '{item_name}' in bucket '{name}' is not defined"
                        ))
                    })?;
                    let mut weight = self.item_weights.get(&item).copied().unwrap_or(WEIGHT_ONE);
                    loop {
                        if self.eat("weight") {
                            weight = self.weight()?;
                        } else if self.eat("pos") {
                            return Err(self
                                .error("item positions (uniform/tree buckets) are not supported"));
                        } else {
                            break;
                        }
                    }
                    items.push((item, weight));
                }
                other => return Err(self.error(format!("bucket {name}: unexpected '{other}'"))),
            }
        }
        let id = match id {
            Some(id) => id,
            None => {
                let mut id = -1;
                while self.used_bucket_ids.contains(&id) {
                    id -= 1;
                }
                self.used_bucket_ids.insert(id);
                id
            }
        };
        for (class, shadow) in shadow_ids {
            self.builder
                .reserve_shadow_id(id, class, shadow)
                .map_err(|e| self.error(e))?;
        }
        let weight = items.iter().fold(0u32, |sum, (_, w)| sum.wrapping_add(*w));
        self.builder
            .add_bucket(BucketSpec {
                id,
                name: name.to_string(),
                type_id,
                items,
            })
            .map_err(|e| self.error(e))?;
        self.item_weights.insert(id, weight);
        self.ids.insert(name.to_string(), id);
        Ok(())
    }

    fn rule(&mut self) -> Result<(), CrushError> {
        let name = match self.word()? {
            "{" => String::new(),
            name => {
                self.expect("{")?;
                name.to_string()
            }
        };
        let mut id = None;
        let mut steps = Vec::new();
        loop {
            match self.word()? {
                "}" => break,
                "id" | "ruleset" => id = Some(self.number::<u32>()?),
                "type" => {
                    // replicated, erasure or a number: it does not change the mapping.
                    self.word()?;
                }
                "min_size" | "max_size" => {
                    self.number::<i32>()?;
                }
                "step" => steps.push(self.step()?),
                other => return Err(self.error(format!("rule {name}: unexpected '{other}'"))),
            }
        }
        let id = id.ok_or_else(|| self.error(format!("rule {name} has no id")))?;
        let name = if name.is_empty() {
            format!("rule{id}")
        } else {
            name
        };
        self.builder
            .add_rule(Rule { id, name, steps })
            .map_err(|e| self.error(e))
    }

    fn step(&mut self) -> Result<Step, CrushError> {
        let op = self.word()?;
        Ok(match op {
            "take" => {
                let item_name = self.word()?;
                let item = *self.ids.get(item_name).ok_or_else(|| {
                    self.error(format!("step take: item '{item_name}' not defined"))
                })?;
                if self.eat("class") {
                    let class = self.word()?;
                    Step::Take(
                        self.builder
                            .shadow_of(item, class)
                            .map_err(|e| self.error(e))?,
                    )
                } else {
                    Step::Take(item)
                }
            }
            "choose" | "chooseleaf" => {
                let mode = match self.word()? {
                    "firstn" => Mode::Firstn,
                    "indep" => Mode::Indep,
                    other => {
                        return Err(self.error(format!("expected firstn or indep, found '{other}'")))
                    }
                };
                let count = self.number()?;
                self.expect("type")?;
                let type_name = self.word()?;
                let type_id = self
                    .builder
                    .type_id(type_name)
                    .ok_or_else(|| self.error(format!("type '{type_name}' not defined")))?;
                Step::Choose {
                    leaf: op == "chooseleaf",
                    mode,
                    count,
                    type_id,
                }
            }
            "emit" => Step::Emit,
            "set_choose_tries" => Step::SetChooseTries(self.number()?),
            "set_chooseleaf_tries" => Step::SetChooseleafTries(self.number()?),
            "set_choose_local_tries" => Step::SetChooseLocalTries(self.number()?),
            "set_choose_local_fallback_tries" => Step::SetChooseLocalFallbackTries(self.number()?),
            "set_chooseleaf_vary_r" => Step::SetChooseleafVaryR(self.number()?),
            "set_chooseleaf_stable" => Step::SetChooseleafStable(self.number()?),
            other => return Err(self.error(format!("unknown step '{other}'"))),
        })
    }
}
