// recur's tiktoken.model loader against a tiktoken no one here wrote: the npm package `tiktoken`
// (OpenAI's Rust tiktoken compiled to WebAssembly) with its own cl100k_base and o200k_base
// ranks and patterns. Each vocabulary is written out as a model directory (tiktoken.model from
// tiktoken's own decode_single_token_bytes, the pattern and special tokens in
// tokenizer_config.json), `recur tokenize` encodes a corpus of real text, and every id must be
// tiktoken's. Kimi's pre-tokenizer pattern (which recur knows from the tokenizer class its
// config names) is checked the same way, on o200k's ranks.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import { Tiktoken } from 'tiktoken/lite';
import { ROOT, RECUR } from './lib.mjs';

const require = createRequire(import.meta.url);

// The pattern of Kimi's TikTokenTokenizer (tokenization_kimi.py in the Kimi-K2 / Kimi-Linear
// releases), in tiktoken's Rust regex syntax.
const KIMI_PATTERN = [
  String.raw`[\p{Han}]+`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`\p{N}{1,3}`,
  String.raw` ?[^\s\p{L}\p{N}]+[\r\n]*`,
  String.raw`\s*[\r\n]+`,
  String.raw`\s+(?!\S)`,
  String.raw`\s+`,
].join('|');

// Real, varied text: the tokenizer golden corpus (English prose, code, CJK in many source
// encodings, edge cases), this repository's README and sources, and cases aimed at the
// pattern's corners.
function corpus() {
  const texts = [];
  const golden = path.join(ROOT, 'tests/data/tokenizer-qwen3/encode.jsonl');
  for (const line of fs.readFileSync(golden, 'utf8').split('\n')) {
    if (line.trim()) texts.push(JSON.parse(line).text);
  }
  for (const f of ['README.md', 'src/tokenizer/bpe.cpp', 'tests/server/lib.mjs']) {
    const text = fs.readFileSync(path.join(ROOT, f), 'utf8');
    texts.push(text);
    texts.push(...text.split('\n\n').filter((p) => p.length > 0));
  }
  texts.push(
    "I'm sure they'll say it's fine, but we'd've known. DON'T SHOUT, He'S YOU'RE I'LL",
    'Numbers: 1 12 123 1234 12345 3.14159 -42 1e-9 0x1F 1,000,000 ٣٤٥ ١٢٣٤ ⅷ ²³',
    'spaces:  two   three    four\ttab\t\ttabs\n\nnewlines\r\n\r\nCRLF \n \n   trailing   ',
    '        indented code\n    if (x) {\n        return y;\n    }\n',
    'emoji 😀😃😄 👩‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️ 👍🏽 and 🤖🧠',
    '中文文本测试，包含标点。日本語のテキスト、ひらがなとカタカナ。한국어 텍스트입니다.',
    '混合English和中文mixed在一起123个数字',
    'Ελληνικά κείμενο, русский текст, עברית, العربية, हिन्दी पाठ, ไทย',
    'combining: e\u0301 a\u0308 n\u0303 Z\u0327\u0301 ǅungla Ǆ ǈ',
    'URLs https://example.com/path?q=1&r=2#frag and emails a.b+c@d.org',
    '<|endoftext|> special <|endofprompt|> tokens <|endoftext|><|endoftext|>x',
    '\u00a0non-breaking\u2003em space\u3000ideographic\u2028line sep\u0085nel',
    '```python\ndef f(x: int) -> int:\n    return x ** 2  # square\n```',
    'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
    '!!!???...,,,;;;:::---___===+++***&&&^^^%%%$$$###@@@~~~```|||\\\\\\///',
    'MixedCASEWordsLikeThis and camelCaseIdentifiers snake_case_names',
    '',
    ' ',
    '\n',
    '   \n\n   \t',
  );
  return texts;
}

function encoder(name) {
  return require(`tiktoken/encoders/${name}.json`);  // {pat_str, special_tokens, bpe_ranks}
}

// A model directory for `recur tokenize`: tiktoken.model written from tiktoken's own
// decode_single_token_bytes, for every rank below the special tokens.
function writeModelDir(enc, specials, config) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'recur-tiktoken-'));
  const firstSpecial = Math.min(...Object.values(specials));
  const lines = [];
  for (let rank = 0; rank < firstSpecial; ++rank) {
    let bytes;
    try {
      bytes = enc.decode_single_token_bytes(rank);
    } catch {
      continue;  // a rank no token has
    }
    lines.push(`${Buffer.from(bytes).toString('base64')} ${rank}`);
  }
  assert.equal(lines.length, enc.token_byte_values().length, 'every ranked token was written');
  fs.writeFileSync(path.join(dir, 'tiktoken.model'), lines.join('\n') + '\n');
  const added = {};
  for (const [content, id] of Object.entries(specials)) {
    added[String(id)] = { content, lstrip: false, normalized: false, rstrip: false,
                          single_word: false, special: true };
  }
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'),
                   JSON.stringify({ ...config, added_tokens_decoder: added }, null, 1));
  return { dir, base: lines.length };
}

function recurIds(dir, texts) {
  const input = path.join(dir, 'texts.jsonl');
  fs.writeFileSync(input, texts.map((text) => JSON.stringify({ text })).join('\n') + '\n');
  const out = execFileSync(RECUR, ['tokenize', '--model', dir, '--jsonl', input],
                           { encoding: 'utf8', maxBuffer: 1 << 28 });
  return out.trim().split('\n').map((l) => JSON.parse(l).ids);
}

function compare(enc, dir, texts) {
  const got = recurIds(dir, texts);
  assert.equal(got.length, texts.length);
  let tokens = 0;
  for (let i = 0; i < texts.length; ++i) {
    const want = Array.from(enc.encode(texts[i], 'all'));
    tokens += want.length;
    assert.deepEqual(got[i], want, `text ${i}: ${JSON.stringify(texts[i].slice(0, 80))}`);
  }
  assert.ok(tokens > 20000, `the corpus is ${tokens} tokens`);
}

for (const name of ['cl100k_base', 'o200k_base']) {
  test(`${name}: recur encodes a real corpus exactly as tiktoken does`, () => {
    const e = encoder(name);
    const enc = new Tiktoken(e.bpe_ranks, e.special_tokens, e.pat_str);
    const { dir } = writeModelDir(enc, e.special_tokens, { pat_str: e.pat_str });
    try {
      compare(enc, dir, corpus());
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
}

test("Kimi's pattern and reserved special tokens, on o200k's ranks", () => {
  const e = encoder('o200k_base');
  const plain = new Tiktoken(e.bpe_ranks, {}, KIMI_PATTERN);
  const base = plain.token_byte_values().length;
  plain.free();
  // Kimi's layout: the 258 ids after the ranks are special; the config names some, the rest
  // are <|reserved_token_ID|> (named here only for tiktoken; recur derives them).
  const named = { '[BOS]': base, '[EOS]': base + 1, '<|im_end|>': base + 2,
                  '<|im_user|>': base + 3, '<|im_middle|>': base + 17 };
  const specials = { ...named };
  for (let id = base; id < base + 258; ++id) {
    if (!Object.values(named).includes(id)) specials[`<|reserved_token_${id}|>`] = id;
  }
  const enc = new Tiktoken(e.bpe_ranks, specials, KIMI_PATTERN);
  const { dir } = writeModelDir(enc, named, {
    auto_map: { AutoTokenizer: ['tokenization_kimi.TikTokenTokenizer', null] },
    tokenizer_class: 'TikTokenTokenizer',
  });
  try {
    const texts = corpus();
    texts.push(`<|im_user|>user<|im_middle|>hi<|im_end|><|reserved_token_${base + 100}|>x`);
    compare(enc, dir, texts);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
