"""chat.conversations: the prompt key a store holds for each sample."""

from chat.conversations import prompt_key


def test_prompt_key_is_the_prompt_not_the_answer():
    q = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    a, b = q + [{"role": "assistant", "content": "4"}], q + [{"role": "assistant", "content": "four"}]
    assert prompt_key(a) == prompt_key(b) == prompt_key(q)
    assert prompt_key(a) != prompt_key([q[1], a[2]])  # the system turn is part of the prompt
    assert prompt_key(a) != prompt_key([q[0], {"role": "user", "content": "2+3?"}, a[2]])
    assert 0 <= prompt_key(a) < 2**63
