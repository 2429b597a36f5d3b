// The model directory the Kimi end-to-end tests (kimi_tools, kimi_tool_constraint) serve: Kimi's
// tokenizer files (tests/data/kimi-tokenizer-tiny: tiktoken.model, tokenizer_config.json naming
// Kimi's tokenizer class, Kimi-Linear's chat template) over the tiny Qwen3.5 checkpoint's
// weights, linked into a fresh temporary directory that the caller removes.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { ROOT } from './lib.mjs';

const WEIGHTS = path.join(ROOT, 'tests/data/qwen3_5-chat-tiny');
export const KIMI = path.join(ROOT, 'tests/data/kimi-tokenizer-tiny');
export const KIMI_NAME = 'kimi-chat-tiny';

// A directory named after `prefix`. With `outputs` ({key: text}) its tokenizer_config.json is
// Kimi's plus one added token per key whose text is the value (ids past Kimi's special tokens,
// inside the model's vocabulary), and `ids` maps each key to its token's id; without, it is
// Kimi's own.
export function kimiModelDir(prefix, outputs = null) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), prefix));
  const link = (from, f) => fs.symlinkSync(fs.realpathSync(path.join(from, f)), path.join(dir, f));
  for (const f of ['config.json', 'generation_config.json', 'model.safetensors']) link(WEIGHTS, f);
  for (const f of ['tiktoken.model', 'chat_template.jinja']) link(KIMI, f);
  const ids = {};
  if (!outputs) {
    link(KIMI, 'tokenizer_config.json');
    return { dir, ids };
  }
  const config = JSON.parse(fs.readFileSync(path.join(KIMI, 'tokenizer_config.json'), 'utf8'));
  let next = 1024 + 258;  // after the ranks and Kimi's special-token ids
  for (const [key, content] of Object.entries(outputs)) {
    ids[key] = next;
    config.added_tokens_decoder[String(next++)] = {
      content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: false,
    };
  }
  fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config));
  return { dir, ids };
}
