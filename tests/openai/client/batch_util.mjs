// What the batch tests share: JSONL input files, uploads, waiting for a
// batch to end, reading an output file.
import assert from 'node:assert/strict';
import { toFile } from 'openai';
import { MODEL } from './common.mjs';

export function jsonl(lines) {
  return lines.map((l) => JSON.stringify(l)).join('\n') + '\n';
}

export function completionLine(id, prompt, extra = {}) {
  return {
    custom_id: id, method: 'POST', url: '/v1/completions',
    body: { model: MODEL, prompt, max_tokens: 6, temperature: 0, ignore_eos: true, ...extra },
  };
}

export async function upload(cl, text, name = 'input.jsonl') {
  return cl.files.create({ file: await toFile(Buffer.from(text), name), purpose: 'batch' });
}

// Polls until the batch is final (or `ms` pass).
export async function waitFinal(cl, id, ms = 120_000) {
  const end = Date.now() + ms;
  for (;;) {
    const b = await cl.batches.retrieve(id);
    if (['completed', 'failed', 'cancelled', 'expired'].includes(b.status)) return b;
    assert.ok(Date.now() < end, `batch ${id} still ${b.status} after ${ms} ms: ${JSON.stringify(b)}`);
    await new Promise((r) => setTimeout(r, 250));
  }
}

export function parseLines(text) {
  return text.split('\n').filter((l) => l.length > 0).map((l) => JSON.parse(l));
}
