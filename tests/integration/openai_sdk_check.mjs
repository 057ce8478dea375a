// Drives `tessera serve` with the official OpenAI SDK for Node.js, as a user's program would.
// Run by tests/integration/serve_test.cpp:
//   OPENAI_SDK=<dir of the openai package> BASE_URL=http://127.0.0.1:PORT/v1 API_KEY=... \
//   MODEL=<served name> node openai_sdk_check.mjs
// Prints one line per check and "ALL OK" at the end; exits non-zero on the first failure.
const { default: OpenAI } = await import(process.env.OPENAI_SDK + '/index.mjs');

const client = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: process.env.API_KEY, maxRetries: 0 });
const model = process.env.MODEL;

function check(cond, what) {
  if (!cond) {
    console.log('FAIL ' + what);
    process.exit(1);
  }
  console.log('ok ' + what);
}

const models = await client.models.list();
check(models.data.length >= 1 && models.data[0].id === model, 'models.list names the served model');

const completion = await client.completions.create({
  model, prompt: 'The capital of France is', max_tokens: 8, temperature: 0,
});
check(completion.choices.length === 1 && completion.choices[0].text.length > 0,
      'completions.create returns text');
check(completion.usage.completion_tokens === 8 && completion.choices[0].finish_reason === 'length',
      'completions usage and finish_reason');

// A stream adds up to the same text as the non-streaming answer (greedy).
const stream = await client.completions.create({
  model, prompt: 'The capital of France is', max_tokens: 8, temperature: 0, stream: true,
});
let streamed = '';
for await (const chunk of stream) streamed += chunk.choices[0]?.text ?? '';
check(streamed === completion.choices[0].text, 'a completions stream equals the whole answer');

const chat = await client.chat.completions.create({
  model, messages: [{ role: 'user', content: 'Hello!' }], max_tokens: 6, temperature: 0,
});
check(chat.choices[0].message.role === 'assistant' && chat.usage.completion_tokens === 6,
      'chat.completions.create answers as the assistant');

const chatStream = await client.chat.completions.create({
  model, messages: [{ role: 'user', content: 'Hello!' }], max_tokens: 6, temperature: 0,
  stream: true, stream_options: { include_usage: true },
});
let chatText = '';
let usage = null;
for await (const chunk of chatStream) {
  if (chunk.usage) usage = chunk.usage;
  chatText += chunk.choices[0]?.delta?.content ?? '';
}
check(chatText === chat.choices[0].message.content, 'a chat stream equals the whole answer');
check(usage && usage.completion_tokens === 6, 'stream_options.include_usage ends with usage');

// Tools go through the chat template and the hermes parser (this random model writes no call,
// so the answer is content; the parser's calls are checked in tests/server).
const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather',
  parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];
const withTools = await client.chat.completions.create({
  model, messages: [{ role: 'user', content: 'Weather in Paris?' }], tools, max_tokens: 6,
  temperature: 0,
});
check(['stop', 'length', 'tool_calls'].includes(withTools.choices[0].finish_reason) &&
      withTools.choices[0].message.role === 'assistant', 'chat with tools answers');
const toolStream = await client.chat.completions.create({
  model, messages: [{ role: 'user', content: 'Weather in Paris?' }], tools, max_tokens: 6,
  temperature: 0, stream: true,
});
let toolText = '';
let finish = null;
for await (const chunk of toolStream) {
  toolText += chunk.choices[0]?.delta?.content ?? '';
  finish = chunk.choices[0]?.finish_reason ?? finish;
}
check(toolText === (withTools.choices[0].message.content ?? '') && finish !== null,
      'a streamed chat with tools equals the whole answer');

// Errors arrive as the SDK's typed errors with the status and message.
try {
  await client.completions.create({ model, prompt: 'hi', max_tokens: 5, temperature: -1 });
  check(false, 'a bad temperature is refused');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.status === 400 && /temperature/.test(e.message),
        'a bad temperature is a BadRequestError naming it');
}
try {
  await client.completions.create({ model: 'no-such-model', prompt: 'hi', max_tokens: 5 });
  check(false, 'an unknown model is refused');
} catch (e) {
  check(e instanceof OpenAI.NotFoundError && e.status === 404, 'an unknown model is a NotFoundError');
}
if (process.env.API_KEY !== 'none') {
  const wrong = new OpenAI({ baseURL: process.env.BASE_URL, apiKey: 'wrong-key', maxRetries: 0 });
  try {
    await wrong.models.list();
    check(false, 'a wrong API key is refused');
  } catch (e) {
    check(e instanceof OpenAI.AuthenticationError && e.status === 401,
          'a wrong API key is an AuthenticationError');
  }
}
console.log('ALL OK');
