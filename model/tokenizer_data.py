"""The English text the tiny checkpoint's byte-level BPE tokenizer is trained on.

Written for this project (no third-party text). It only needs common words, punctuation, digits
and some code-like lines so that the learned merges are plausible; any change to it changes the
tiny tokenizer, so bump ``model.checkpoint.CHECKPOINT_VERSION`` together with it.
"""

TRAINING_TEXT = """\
The morning train left the station at seven, and most of the people on it were going to work.
A woman near the window was reading a book about the history of the river. She turned the pages
slowly, as if she wanted the journey to last a little longer. Across from her, a young man wrote
numbers into a small notebook: 12, 48, 96, 128, 256, 512, 1024. He was counting something, but
nobody asked him what it was.

When the train stopped in the city, the doors opened and the crowd moved out onto the platform.
It was cold, and the sky was the colour of old paper. The woman put her book in her bag and
walked towards the bridge. She had lived in this city for ten years, and she still liked the
sound of the water under the bridge in the early morning.

Her office was on the fourth floor of a building that had once been a warehouse. The windows were
tall and the floors were made of wood. She made a cup of tea, opened her computer and read the
messages that had arrived during the night. There were questions from a team in another country,
a report about the last week, and a short note from her friend: "Are we still meeting on Friday?"

She answered the note first. "Yes, of course. Let us meet at the small cafe near the park, at
six o'clock. I will bring the map you wanted to see." Then she started on the report.

The report described a system that answers questions. It reads a question, breaks it into small
pieces called tokens, and then predicts the next token again and again until the answer is
complete. Each step looks back at everything that was said before. To make this fast, the system
keeps a memory of what it has already computed, so that it does not need to do the same work
twice. This memory is called a cache. When many people ask questions at the same time, the cache
grows very large, and it no longer fits in the fast memory of the machine.

The team had found a simple idea. Most of the cache is not needed at every step. For each new
token, a small and quick model decides which parts of the past are important, and only those
parts are brought back into the fast memory. The rest can wait in the larger, slower memory of
the host computer. If the choice is made carefully, the answer is exactly the same as before, but
many more questions can be answered at once.

She liked the idea because it was honest about its limits. The report gave the numbers plainly:
how many tokens per second, how much memory was used, and how long each person had to wait for
the first word of an answer. It also listed the cases where the idea did not help, for example
when there was only one question at a time, or when every question was very short.

In the afternoon she went for a walk in the park. Children were playing near the pond, and an
old man was feeding the birds with pieces of bread. The trees had lost most of their leaves, and
the paths were covered in red and yellow. She thought about the report and about the questions
from the other team. Some of them were easy to answer. Others would need a few more days of work.

Back at her desk, she wrote a short program to check one of the numbers:

    def average(values):
        total = 0
        for value in values:
            total += value
        return total / len(values)

    print(average([3, 5, 8, 13, 21]))

The program printed 10.0, which was the number she expected. She added a test, saved the file,
and sent a message to the team: "The average is correct. The problem must be somewhere else. I
will look at the input data tomorrow morning, when I have more time."

On Friday evening she met her friend at the cafe. The room was warm and full of people. They
talked about their work, about a film they had both seen, and about a trip they wanted to take in
the spring. Her friend wanted to go to the mountains; she wanted to go to the sea. In the end they
agreed to do both: three days in the mountains, then four days by the sea.

"Do you ever think about how strange it is," her friend asked, "that a machine can write a
sentence that sounds like a person?" She thought for a moment. "It is strange, but it is also
very ordinary. It learns from what people have written, so it sounds like us. The hard part is
not making it speak. The hard part is making it useful, and making it fast enough that nobody
has to wait."

They walked home together along the river. The lights of the city were reflected in the dark
water, and the air smelled of rain. It had been a long week, and she was glad it was over.
"""
