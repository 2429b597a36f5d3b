// Writes this directory's tiktoken.model and tokenizer_config.json: the first 1,024 ranks of
// o200k_base (every byte and the merges among them, from the npm package tiktoken) as a tiny
// vocabulary, and Kimi's added tokens at Kimi's offsets after it (Kimi-Linear puts [BOS] at
// 163,584 = its rank count; here at 1,024). Run from the repository root after
// scripts/install-deps.sh:  node tests/data/kimi-tokenizer-tiny/make.mjs
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, '../../server/package.json'));
const { Tiktoken } = require('tiktoken/lite');
const o200k = require('tiktoken/encoders/o200k_base.json');

const RANKS = 1024;
const enc = new Tiktoken(o200k.bpe_ranks, {}, o200k.pat_str);
const lines = [];
for (let rank = 0; rank < RANKS; ++rank) {
  lines.push(`${Buffer.from(enc.decode_single_token_bytes(rank)).toString('base64')} ${rank}`);
}
enc.free();
fs.writeFileSync(path.join(here, 'tiktoken.model'), lines.join('\n') + '\n');

// Kimi's ids minus 163,584; the tool-call markers and <think> are not special (kept in text
// decoded with skip_special_tokens, where the server parses them).
const KIMI = [
  [0, '[BOS]', true], [1, '[EOS]', true], [2, '<|im_end|>', true], [3, '<|im_user|>', true],
  [4, '<|im_assistant|>', true], [6, '<|start_header_id|>', true],
  [7, '<|end_header_id|>', true], [9, '[EOT]', true], [10, '<|im_system|>', true],
  [11, '<|tool_calls_section_begin|>', false], [12, '<|tool_calls_section_end|>', false],
  [13, '<|tool_call_begin|>', false], [14, '<|tool_call_argument_begin|>', false],
  [15, '<|tool_call_end|>', false], [17, '<|im_middle|>', true], [22, '<think>', false],
  [23, '</think>', false], [254, '[UNK]', true], [255, '[PAD]', true],
];
const added = {};
for (const [offset, content, special] of KIMI) {
  added[String(RANKS + offset)] = {
    content, lstrip: false, normalized: false, rstrip: false, single_word: false, special,
  };
}
const config = {
  added_tokens_decoder: added,
  auto_map: { AutoTokenizer: ['tokenization_kimi.TikTokenTokenizer', null] },
  bos_token: '[BOS]',
  clean_up_tokenization_spaces: false,
  eos_token: '[EOS]',
  extra_special_tokens: {},
  model_max_length: 1048576,
  pad_token: '[PAD]',
  tokenizer_class: 'TikTokenTokenizer',
  unk_token: '[UNK]',
};
fs.writeFileSync(path.join(here, 'tokenizer_config.json'), JSON.stringify(config, null, 2) + '\n');
