"""The data room: what train.py reads, one file per step in the order the data flows, each taking
only from the ones before it (docs/data.md):

    sources.py   the data options' files or Hub dataset (read by common/data.py), where a row lies
                 in its file, a mixture's sources (--data_mixture)
    formats.py   rows -> examples: text, or conversations (messages, OpenAI content parts, ShareGPT)
    render.py    examples -> token ids and a trained mask (the chat template, the assistant's tokens)
    packing.py   tokenised examples -> rows: blocks with document masks, or one example per row
    assemble.py  train.py's datasets: one source or a weighted mixture; setup lines, resume identity,
                 the held-out loss per source
    at_scale.py  waiting for rank 0's tokenising (--data_timeout), --streaming
"""
