// A tool call through the official OpenAI SDK for Node.js, against `tessera serve` of a model
// that writes one (serve_test's scripted model). Run by tests/integration/serve_test.cpp:
//   OPENAI_SDK=<dir> BASE_URL=http://127.0.0.1:PORT/v1 API_KEY=... MODEL=<name> \
//   WANT_CALL='{"name": ..., "arguments": {...}}' node openai_sdk_tool_call.mjs
// Prints one line per check and "ALL OK" at the end; exits non-zero on the first failure.
import { isDeepStrictEqual } from 'node:util';

const { default: OpenAI } = await import(process.env.OPENAI_SDK + '/index.mjs');
const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: process.env.API_KEY, maxRetries: 0 });
const model = process.env.MODEL;
const want = JSON.parse(process.env.WANT_CALL);

function check(cond, what) {
  if (!cond) {
    console.log('FAIL ' + what);
    process.exit(1);
  }
  console.log('ok ' + what);
}

const tools = [{ type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
  parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } } } } }];
const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];

const reply = await client.chat.completions.create({ model, messages, tools, max_tokens: 64, temperature: 0 });
const choice = reply.choices[0];
check(choice.finish_reason === 'tool_calls', 'finish_reason is tool_calls');
const calls = choice.message.tool_calls ?? [];
check(calls.length === 1 && calls[0].type === 'function' && calls[0].id.length > 0, 'one function call with an id');
check(calls[0].function.name === want.name, 'the call names the function');
check(isDeepStrictEqual(JSON.parse(calls[0].function.arguments), want.arguments), 'its arguments parse to what the model wrote');

const stream = await client.chat.completions.create({ model, messages, tools, max_tokens: 64, temperature: 0, stream: true });
let name = '', args = '', content = '', finish = null;
for await (const chunk of stream) {
  const c = chunk.choices[0];
  if (!c) continue;
  content += c.delta?.content ?? '';
  for (const t of c.delta?.tool_calls ?? []) {
    name += t.function?.name ?? '';
    args += t.function?.arguments ?? '';
  }
  if (c.finish_reason) finish = c.finish_reason;
}
check(name === want.name && isDeepStrictEqual(JSON.parse(args), want.arguments), 'the streamed call adds up to the same call');
check(content === '' && finish === 'tool_calls', 'a streamed call is no content and ends with tool_calls');
console.log('ALL OK');
