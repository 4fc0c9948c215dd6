"""Original training text for the tiny test tokenizer: prose, code, numbers, Chinese and emoji."""

from __future__ import annotations

_PROSE = """\
The morning train left the station four minutes late, and nobody seemed to mind.
A small cat slept on the warm hood of a parked car until the owner came back.
She wrote the shopping list on the back of an old concert ticket.
Rain fell all afternoon, so the children built a fort out of sofa cushions.
He forgot his umbrella again, which surprised exactly no one in the office.
The library closes at eight on weekdays and at five on Saturdays.
Our neighbour grows tomatoes, beans, and a stubborn pumpkin that refuses to ripen.
The bridge was painted bright orange so that ships could see it through the fog.
Every spring the river floods the lower meadow and the herons return.
If you turn left at the bakery, the museum is on your right.
The old clock in the hall gains a minute every week.
We watched the storm roll in from the hills while the kettle boiled.
A good map is worth more than a fast car when you are lost.
The recipe calls for two eggs, a cup of flour, and a pinch of salt.
Most of the tickets were sold within an hour of the announcement.
The committee met twice but could not agree on the colour of the new logo.
The lighthouse keeper kept a diary of every ship that passed.
Bicycles are parked in neat rows outside the university gates.
The soup needed more pepper, according to everyone except the cook.
A quiet street can become very loud when the school bell rings.
The hikers reached the summit just before the clouds closed in.
He reads the newspaper from the last page to the first.
The garden gate squeaks, and the dog barks whenever it opens.
Snow covered the village overnight, muffling every sound.
The museum guide spoke slowly so that everyone could follow.
They planted an oak tree to celebrate the opening of the new school.
The market sells fresh bread, cheese, honey, and hand-made soap.
I left a note on the fridge, but the milk was gone anyway.
The violinist tuned her instrument twice before the concert began.
Clear instructions save more time than clever shortcuts.
The baker starts work at four in the morning, long before sunrise.
After the power cut, the whole street ate dinner by candlelight.
The ferry crosses the bay every half hour during the summer.
Please remember to water the plants while I am away.
The mountain road has forty-two hairpin bends and no guard rail.
A gentle breeze carried the smell of cut grass across the field.
The engineer checked the measurements a third time before signing off.
Two owls called to each other across the dark valley.
The students argued about whether a hot dog counts as a sandwich.
Nobody knew who had left the bicycle leaning against the fountain.
The cafe on the corner makes the best lemon cake in town.
Thunder rolled in the distance, but the sky above us stayed blue.
She learned to juggle during the long winter holidays.
The translator kept a notebook of words that have no direct equivalent.
Whenever the wind blows from the east, the harbour smells of salt and diesel.
The cinema shows old films on Tuesday nights for half price.
A pair of swans nested on the small island in the middle of the lake.
The orchestra rehearsed the final movement until midnight.
Our train was replaced by a bus, which took twice as long.
The first snowdrops appeared in the garden at the end of January.
A friendly argument is a good way to test an idea.
The cartographer drew the coastline from memory and got it almost right.
When the tide goes out, you can walk to the island on foot.
He measured twice, cut once, and still had to start over.
The teacher asked the class to describe the colour of the sea.
A bowl of cherries sat on the table, untouched.
Many small steps add up to a long journey.
The shopkeeper counted the coins slowly and smiled.
In the evening the square fills with musicians and street vendors.
The puzzle had a thousand pieces, and three of them were missing.
Questions are cheap; good answers take time.
The paint was still wet, so someone put up a sign.
The cyclists waited at the red light even though the road was empty.
We found an old photograph of the house in the attic.
The robot vacuum got stuck under the sofa for the third time today.
A single candle can light a thousand others without losing its flame.
The volcano has been quiet for two hundred years.
The farmer said the apples would be ready by the end of September.
He hummed the same tune all day without noticing.
The waves were taller than the harbour wall during the storm.
"""

_TECH = """\
The scheduler picks which sequences run in the next step of the engine.
Each block of the key-value cache holds sixty-four tokens of one sequence.
A prefix cache lets two requests with the same system prompt share memory.
The sampler applies the repetition penalty before the temperature.
Greedy decoding always chooses the most likely next token.
Top-p sampling keeps the smallest set of tokens whose probability reaches p.
The tokenizer splits text into pieces and maps each piece to an integer id.
Byte-level encoding means that any string can be represented, even emoji.
The model returns logits with one value for every token in the vocabulary.
Attention lets each position look at every earlier position in the sequence.
A rotary embedding rotates query and key vectors by an angle that depends on position.
Quantized weights use fewer bits, which saves memory and bandwidth.
The server streams tokens to the client as soon as they are decoded.
If the queue is full, the server answers with status 503 and a retry hint.
Continuous batching inserts new requests while others are still generating.
Chunked prefill splits a long prompt across several steps.
The benchmark measures tokens per second and time to first token.
A stop string ends the generation when it appears in the output text.
The chat template turns a list of messages into a single prompt.
Every kernel is checked against the reference implementation.
Set the seed to get the same tokens on every run.
The block manager frees the blocks of a finished sequence immediately.
Tensor parallelism splits each weight matrix across several devices.
Memory bandwidth, not arithmetic, limits the speed of decoding.
The configuration file lists the hidden size, the number of layers and the vocabulary size.
Logprobs report how likely the model found each generated token.
"""

_CODE = """\
def add(a, b):
    return a + b
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
class Counter:
    def __init__(self) -> None:
        self.count = 0
    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count
import json
data = json.loads('{"name": "flashllm", "version": 1, "tags": ["fast", "small"]}')
print(f"hello, {data['name']}!")
for i, word in enumerate(["alpha", "beta", "gamma"]):
    print(i, word.upper())
if __name__ == "__main__":
    main()
result = [x * x for x in range(10) if x % 2 == 0]
with open("notes.txt", "w", encoding="utf-8") as f:
    f.write("line one\\nline two\\n")
try:
    value = int(text)
except ValueError as exc:
    raise SystemExit(f"not a number: {text!r}") from exc
SELECT id, name FROM users WHERE age > 30 ORDER BY name;
for (int i = 0; i < n; ++i) { sum += values[i]; }
const greet = (name) => `Hello, ${name}!`;
fn main() { println!("{}", 2 + 2); }
git commit -m "fix off-by-one error in the block table"
curl -s http://127.0.0.1:8000/v1/models | python -m json.tool
x = torch.zeros(4, 8, dtype=torch.float16)
assert len(tokens) == 16, "expected sixteen tokens"
<div class="note"><p>Saved &amp; synced.</p></div>
# TODO: handle the empty list case
"""

_NUMBERS = """\
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20
The meeting starts at 09:30 and ends at 11:15.
Call 555-0142 before 6 pm, or write to room 221B.
Pi is roughly 3.14159, and e is roughly 2.71828.
The invoice total was $1,234.56 including 20% tax.
In 1969, people walked on the Moon for the first time.
Temperatures ranged from -5 to 12 degrees Celsius.
The answer is 42, the question remains unknown.
2 + 2 = 4, 3 * 7 = 21, 100 / 8 = 12.5, 2 ** 10 = 1024.
Version 2.13.0 was released on 2024-05-17.
The train departs from platform 9 at 14:05.
A kilometre is 1000 metres, and a mile is about 1609 metres.
Order #48213 contains 3 items and ships in 2-4 business days.
The population grew from 8,400 to 12,750 in ten years.
0x1F 0xFF 0b1010 1e-6 6.02e23 -273.15
"""

_CHINESE = """\
今天天气很好，我们去公园散步吧。
这本书很有意思，我已经读了两遍。
他每天早上六点起床，然后去跑步。
请把窗户关上，外面风很大。
我们明天下午三点在图书馆见面。
这家餐厅的饺子非常好吃。
学习一门新的语言需要耐心和时间。
小猫在沙发上睡着了。
火车晚点了十分钟，但是大家都不着急。
你好，世界！这是一个简单的测试。
模型根据前面的词预测下一个词。
春天来了，花园里的花都开了。
他用中文写了一封信给他的朋友。
长城是中国最有名的古迹之一。
我喜欢喝绿茶，不太喜欢咖啡。
"""

_EMOJI = """\
Good morning! ☀️ Coffee first ☕ then work 💻
Happy birthday 🎂🎉 hope you have a great day 🥳
The team shipped the release 🚀🚀🚀 well done 👏
Rainy day again 🌧️ staying in with a book 📚
We saw a fox 🦊 and two deer 🦌 on the trail 🌲
Thanks a lot 🙏 see you tomorrow 👋
Family photo: 👨‍👩‍👧‍👦 at the beach 🏖️ with ice cream 🍦
Thumbs up 👍 👍🏽 👍🏿 from everyone
Pizza 🍕 or sushi 🍣 tonight? 🤔
Great job 💯 keep going 💪 🔥
"""

_MIXED = """\
The word 你好 means hello, and 谢谢 means thank you 🙂
Café, naïve, résumé, jalapeño and Zürich all need accents.
Greek letters: α β γ δ λ π σ ω, and the arrow → points right.
Temperature ±0.5 °C, angle 90°, ratio ≤ 1 and ≥ 0.
Привет, мир! Это тест. Καλημέρα κόσμε.
こんにちは世界、今日はいい天気ですね。
The ∑ of the list was ∞ by mistake ✗, fixed it ✓
Use the <|im_start|> marker only inside chat templates.
"""


def _sentences() -> list[str]:
    lines: list[str] = []
    for block in (_PROSE, _TECH, _CODE, _NUMBERS, _CHINESE, _EMOJI, _MIXED):
        lines.extend(line for line in block.splitlines() if line.strip())
    return lines


# Deterministic extra lines so the tokenizer sees numbers and sentence shapes in many contexts.
_EXTRA = [
    f"Step {i}: the batch held {i * 3 % 17 + 1} sequences and produced {i * 7 % 23 + 5} tokens."
    for i in range(60)
] + [f"Item {i} costs {i * 1.25:.2f} dollars, 第{i}个 ✓" for i in range(40)]

CORPUS: list[str] = _sentences() + _EXTRA
