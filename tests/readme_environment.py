from services.environments import Environment


class NextLetter(Environment):
    """Three rounds: the environment shows a letter, the model answers the one after it."""

    def reset(self, row, seed):
        self.letter, self.round = row["start"], 0
        return self.letter

    def step(self, action):
        expected = chr(ord(self.letter) + 1)
        self.letter, self.round = expected, self.round + 1
        done = self.round == 3
        return (None if done else expected), float(action.strip() == expected), done, {}

    def rows(self):
        return [{"start": letter} for letter in "bcdefghijklmnopqr"]
